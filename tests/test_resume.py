"""Exact resume: a run of 4 rollouts and a run of 2 that is stopped and resumed for 2 more end identical."""

from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir
from helpers.processes import own_session_with_ctrl_c
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
CONFIG = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


def stop_and_resume(tmp_path, common, first_half=()) -> Path:
    """4 rollouts in one run ("full"), and 2 stopped then resumed from last.ckpt for 2 more ("part").

    Both must end with the same policy; returns the checkpoint the resume started from.
    """
    run_amir([*common, "--trainer.max_epochs", "4", "--trainer.logger.init_args.name", "full"], tmp_path)
    run_amir([*common, *first_half, "--trainer.max_epochs", "2", "--trainer.logger.init_args.name", "part"], tmp_path)
    checkpoint = tmp_path / "runs" / "part" / "version_0" / "checkpoints" / "last.ckpt"
    resume = ["--trainer.max_epochs", "4", "--trainer.logger.init_args.name", "part", "--ckpt_path", str(checkpoint)]
    run_amir([*common, *resume], tmp_path)
    full = load_file(tmp_path / "runs" / "full" / "version_0" / "policy" / "model.safetensors")
    resumed = load_file(tmp_path / "runs" / "part" / "version_1" / "policy" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    return checkpoint


def test_stopped_and_resumed_run_matches_the_uninterrupted_one(tmp_path):
    common = ["fit", "--config", CONFIG, "--trainer.deterministic", "true", "--trainer.check_val_every_n_epoch", "3"]
    stop_and_resume(tmp_path, common)
    whole = read_scalars(tmp_path / "runs" / "full" / "version_0")
    halves = read_scalars(tmp_path / "runs" / "part" / "version_0")
    rest = read_scalars(tmp_path / "runs" / "part" / "version_1")
    assert halves["rollout/reward_mean"] + rest["rollout/reward_mean"] == whole["rollout/reward_mean"]
    assert halves["amir/lambda"] + rest["amir/lambda"] == whole["amir/lambda"]


FAULTS = [
    # (what kills the run, extra arguments)
    (
        "during a rollout",
        [
            "--data.engine",
            "faults.KillDuringRollout",
            "--data.engine.init_args.at_call",
            "2",
            "--data.engine.init_args.max_model_len",
            "64",
            "--data.engine.init_args.kv_cache_memory_bytes",
            "33554432",
            "--data.engine.init_args.progress",
            "false",
        ],
    ),
    (
        "before an optimiser step",
        ["--trainer.callbacks+=faults.KillBeforeOptimizerStep", "--trainer.callbacks.at_step", "2"],
    ),
    ("while writing a checkpoint", ["--trainer.plugins+=faults.KillDuringSave", "--trainer.plugins.at_save", "2"]),
]


def test_killed_runs_resume_from_the_last_good_checkpoint(tmp_path):
    """SIGKILL in three phases, resuming after each from last.ckpt: the end state equals an uninterrupted run's."""
    import os
    import subprocess
    import sys

    common = [
        "fit",
        "--config",
        CONFIG,
        "--trainer.deterministic",
        "true",
        "--trainer.check_val_every_n_epoch",
        "9",
        "--trainer.max_epochs",
        "6",
    ]
    run_amir([*common, "--trainer.logger.init_args.name", "clean"], tmp_path)
    checkpoint = tmp_path / "runs" / "faulty" / "version_0" / "checkpoints" / "last.ckpt"
    env = dict(
        os.environ,
        AMIR_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=str(Path(__file__).parent / "helpers") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    kills = 0
    for _, extra in FAULTS:
        resume = ["--ckpt_path", str(checkpoint)] if checkpoint.exists() else []
        args = [
            *common,
            "--trainer.logger.init_args.name",
            "faulty",
            "--trainer.logger.init_args.version",
            "0",
            *resume,
            *extra,
        ]
        result = subprocess.run(
            [sys.executable, "-m", "amir_lightning", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == -9, result.stderr[-3000:]  # killed, as injected
        kills += 1
        torch.load(checkpoint, weights_only=True)  # the last checkpoint is always whole (and safe to load)
    assert kills == 3 and list(checkpoint.parent.glob(".*.ckpt.tmp-*"))  # the half-written file was left aside
    run_amir(
        [
            *common,
            "--trainer.logger.init_args.name",
            "faulty",
            "--trainer.logger.init_args.version",
            "0",
            "--ckpt_path",
            str(checkpoint),
        ],
        tmp_path,
    )
    clean = load_file(tmp_path / "runs" / "clean" / "version_0" / "policy" / "model.safetensors")
    faulty = load_file(tmp_path / "runs" / "faulty" / "version_0" / "policy" / "model.safetensors")
    for key in clean:
        assert torch.equal(clean[key], faulty[key]), key


def test_ctrl_c_stops_cleanly_and_leaves_a_loadable_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to the process group) while two workers grade: no traceback, no process left, last.ckpt whole."""
    import os
    import subprocess
    import sys

    env = dict(
        os.environ,
        AMIR_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=str(Path(__file__).parent / "helpers") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    args = ["fit", "--config", CONFIG, "--trainer.max_epochs", "6", "--trainer.check_val_every_n_epoch", "9"]
    args += ["--data.rewards", "[{class_path: faults.CtrlCDuringGrading, init_args: {at_call: 3, num_workers: 2}}]"]
    process = subprocess.Popen(
        [sys.executable, "-m", "amir_lightning", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=own_session_with_ctrl_c,
    )
    try:
        _, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
    assert process.returncode == 130, err[-3000:]  # after Lightning's graceful shutdown; 1 is a reward's error
    assert "Detected KeyboardInterrupt" in err and "Traceback" not in err, err[-3000:]
    group = subprocess.run(["ps", "-o", "stat=,pid=,args=", "-g", str(process.pid)], capture_output=True, text=True)
    alive = [line for line in group.stdout.splitlines() if line.strip() and not line.strip().startswith("Z")]
    assert not alive, f"processes of the run still alive after it exited: {alive}"  # grading workers included
    checkpoint = torch.load(tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["state_dict"]  # the two finished rollouts, loadable


LORA = ["--model.lora", "{r: 4, alpha: 8, target_modules: all-linear}"]


def test_lora_checkpoints_hold_the_adapters_and_resume_exactly(tmp_path):
    """LoRA: last.ckpt holds the adapters, optimiser and loop state and the base model's identity, not the base
    weights; a stopped and resumed run still ends identical; resuming on another base model is refused."""
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = [
        "fit",
        "--config",
        CONFIG,
        *LORA,
        "--trainer.deterministic",
        "true",
        "--trainer.check_val_every_n_epoch",
        "9",
    ]
    # The first half also exports its adapters every rollout (peft directories beside the final export).
    adapters = ["--model.export.every_n_epochs", "1", "--model.export.format", "adapter"]
    checkpoint = stop_and_resume(tmp_path, common, first_half=adapters)
    part = checkpoint.parents[1]
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    weight_keys = [k for k in saved["state_dict"] if k.startswith("model.")]
    assert weight_keys and all(".lora_A." in k or ".lora_B." in k for k in weight_keys)
    assert set(saved["amir"]["base_model"]) == {"source", "config_sha256", "weights_sha256"}
    assert saved["optimizer_states"][0]["state"]  # AdamW's moments of the adapters
    # The adapter export of rollout 1 loads onto the base model with peft.
    base_dir = next((tmp_path / "cache" / "models").iterdir())
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    loaded = PeftModel.from_pretrained(base, str(part / "policy_epoch_1"))
    trained = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert trained and any(p.abs().sum() > 0 for p in trained)  # lora_B starts at zero: it trained
    assert (part / "policy" / "adapter_config.json").is_file()  # the final export in the same format
    # Another base model (the same config, other random weights): the adapters would act on other weights.
    result = subprocess.run(
        [sys.executable, "-m", "amir_lightning", *common, "--trainer.max_epochs", "4", "--ckpt_path", str(checkpoint),
         "--model.policy.init_args.seed", "1"],
        cwd=tmp_path, env={**__import__("os").environ, "AMIR_CACHE": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2  # bad input: one line, as every other
    assert "holds LoRA adapters trained on the base model" in result.stderr and "weights differ" in result.stderr
    assert "Traceback" not in result.stderr


def test_restarting_the_same_command_with_ckpt_path_last_continues_the_run_and_its_curves(tmp_path):
    """A job stopped after 3 rollouts and started again with ``--ckpt_path last`` (what a preempted or requeued job
    does) continues at rollout 4 in the same version folder, so every curve is one; each rollout writes one
    checkpoint, which last.ckpt links to. ``last`` with nothing to resume is one line; ``auto`` then starts fresh."""
    import subprocess
    import sys

    common = ["fit", "--config", CONFIG, "--trainer.check_val_every_n_epoch", "50"]
    run_amir([*common, "--trainer.max_epochs", "3"], tmp_path)
    result = run_amir([*common, "--trainer.max_epochs", "6", "--ckpt_path", "last"], tmp_path)
    runs = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    assert "resuming from runs/tiny/version_0/checkpoints/last.ckpt" in result.stderr
    scalars = read_scalars(runs / "version_0")
    assert len(scalars["rollout/reward_mean"]) == 6 and len(scalars["train/loss"]) == 6
    checkpoints = runs / "version_0" / "checkpoints"  # one file per rollout; last.ckpt links to it
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=5-step=6.ckpt", "last.ckpt"]
    assert (checkpoints / "last.ckpt").readlink().name == "epoch=5-step=6.ckpt"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 6

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    cmd = [sys.executable, "-m", "amir_lightning", *common, "--trainer.max_epochs", "1", "--ckpt_path", "last"]
    failed = subprocess.run(cmd, cwd=fresh, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2
    assert "amir: error: --ckpt_path last: no last.ckpt in runs/tiny/version_*/checkpoints" in failed.stderr
    run_amir([*common, "--trainer.max_epochs", "1", "--ckpt_path", "auto"], fresh)
    assert len(read_scalars(fresh / "runs" / "tiny" / "version_0")["rollout/reward_mean"]) == 1


def test_a_dangling_last_link_resumes_from_the_newest_checkpoint(tmp_path):
    """Killed after writing rollout 3's checkpoint and removing rollout 2's, before relinking last.ckpt: ``last``
    and ``auto`` find rollout 3's file instead of starting the run over, and never a newer one cut short."""
    import os
    import time

    from amir_lightning.checkpoints.resume import resolve_resume

    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "epoch=1-step=2.ckpt").write_bytes(b"older")
    time.sleep(0.01)
    (folder / "epoch=2-step=3.ckpt").write_bytes(b"newest")
    time.sleep(0.01)
    (folder / "epoch=3-step=4.ckpt").mkdir()  # a distributed checkpoint cut short: shards, no meta.pt
    (folder / "epoch=3-step=4.ckpt" / "__0_0.distcp").write_bytes(b"shard")
    (folder / ".epoch=3-step=4.ckpt.tmp-42").write_bytes(b"half")
    os.symlink("epoch=0-step=1.ckpt", folder / "last.ckpt")  # removed already
    logger = {"class_path": "TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "runs"), "name": "tiny"}}
    for wanted in ("last", "auto"):
        config = {"ckpt_path": wanted, "trainer": {"logger": logger}, "checkpoint": {"dirpath": None}}
        resolve_resume(config)
        assert config["ckpt_path"] == str(folder / "epoch=2-step=3.ckpt") and logger["init_args"]["version"] == 0
        del logger["init_args"]["version"]


def test_checkpoints_on_an_fsspec_filesystem_resume_from_there(tmp_path, monkeypatch):
    """``checkpoint.dirpath`` on an fsspec filesystem (``memory://``, as ``s3://`` would be; in this process, where
    that filesystem lives): each rollout writes last.ckpt there, whole and once; ``--ckpt_path last`` finds it and
    the run continues in the same curves; no local folder named after the protocol appears."""
    import fsspec

    from amir_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    common = ["fit", "--config", CONFIG, "--trainer.check_val_every_n_epoch", "50"]
    common += ["--data.engine", "amir_lightning.rollout.HFEngine", "--data.engine.init_args.progress", "false"]
    common += ["--checkpoint.dirpath", "memory://amir-tests/checkpoints"]
    try:
        main([*common, "--trainer.max_epochs", "2"])
        assert fs.ls("/amir-tests/checkpoints", detail=False) == ["/amir-tests/checkpoints/last.ckpt"]
        with fs.open("/amir-tests/checkpoints/last.ckpt", "rb") as fh:
            assert torch.load(fh, weights_only=True)["global_step"] == 2
        main([*common, "--trainer.max_epochs", "3", "--ckpt_path", "last"])
        assert fs.ls("/amir-tests/checkpoints", detail=False) == ["/amir-tests/checkpoints/last.ckpt"]
        with fs.open("/amir-tests/checkpoints/last.ckpt", "rb") as fh:
            assert torch.load(fh, weights_only=True)["global_step"] == 3
    finally:
        fs.rm("/amir-tests", recursive=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "runs"]
    runs = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    assert len(read_scalars(runs / "version_0")["rollout/reward_mean"]) == 3


def test_a_slurm_requeue_resumes_from_its_checkpoint_with_ckpt_path_auto(tmp_path):
    """SLURM's warning before it ends a job (``#SBATCH --signal=USR1@90``), here in the middle of rollout 3's
    generation: Lightning's auto-requeue writes hpc_ckpt_1.ckpt and asks ``scontrol`` to requeue the job, which ends
    it. The requeued job runs the same command with ``--ckpt_path auto``: it resumes from that checkpoint (newer than
    last.ckpt), logs into the same version folder, and ends with the weights of an uninterrupted run. ``scontrol`` is
    a script that records its arguments and ends the job, as SLURM's does (there is no SLURM here)."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `scontrol requeue` ends the running job and queues it again: the script records the call and ends the job.
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\nkill -KILL $PPID\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = str(Path(__file__).parent / "helpers") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(SLURM_NTASKS="1", SLURM_JOB_NAME="amir", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1")
    env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    args = ["fit", "--config", CONFIG, "--trainer.max_epochs", "6", "--trainer.check_val_every_n_epoch", "50"]
    args += ["--trainer.deterministic", "true", "--ckpt_path", "auto"]
    run_amir([*args, "--trainer.logger.init_args.name", "clean"], tmp_path)
    warned = ["--data.engine", "faults.SignalDuringRollout", "--data.engine.init_args.at_call", "3"]
    warned += ["--data.engine.init_args.max_model_len", "64", "--data.engine.init_args.progress", "false"]
    warned += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432"]
    cmd = [sys.executable, "-m", "amir_lightning", *args, *warned]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == -9, first.stderr[-3000:]  # ended by the requeue
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert torch.load(hpc, weights_only=True)["global_step"] == 2  # written during rollout 3

    result = run_amir(args, tmp_path, env=env)
    assert f"--ckpt_path auto: resuming from {hpc}" in result.stderr
    run = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in run.iterdir()) == ["version_0"]
    assert torch.load(run / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    clean = load_file(tmp_path / "runs" / "clean" / "version_0" / "policy" / "model.safetensors")
    requeued = load_file(run / "version_0" / "policy" / "model.safetensors")
    for key in clean:
        assert torch.equal(clean[key], requeued[key]), key
