"""Runs stopped from outside, each in a process of its own: SIGKILL in three phases, Ctrl-C (once and twice),
SIGTERM, SLURM's requeue, a disk that refuses the checkpoint, a reader that goes away. Each must leave a whole last
checkpoint, a clear exit status and, where it resumes, the weights of the uninterrupted run (``clean_six``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_amir, started_server_pid
from helpers import forks
from helpers.processes import count_after, group_after
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
HELPERS = Path(__file__).parents[1] / "helpers"
CONFIG = TINY = str(ROOT / "configs" / "tiny.yaml")
HF = ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]
BASE = ["fit", "--config", TINY, "--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "50"]
BASE += ["--trainer.deterministic", "true", *HF]
#: The runs of 6 rollouts (vLLM, deterministic, no validation) that the stopped runs resume to.
SIX = ["fit", "--config", CONFIG, "--trainer.deterministic", "true", "--trainer.check_val_every_n_epoch", "50"]
SIX += ["--trainer.max_epochs", "6"]


@pytest.fixture(scope="module")
def clean_six(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights after an uninterrupted run of ``SIX``: built once for every test here that resumes."""
    folder = tmp_path_factory.mktemp("clean")
    run_amir([*SIX, "--trainer.logger.init_args.name", "clean"], folder)
    return load_file(folder / "runs" / "clean" / "version_0" / "policy" / "model.safetensors")


def policy(tmp_path, name="run") -> dict[str, torch.Tensor]:
    return load_file(tmp_path / "runs" / name / "version_0" / "policy" / "model.safetensors")


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


def test_killed_runs_resume_from_the_last_good_checkpoint(tmp_path, clean_six):
    """SIGKILL in three phases, resuming after each from last.ckpt: the end state equals an uninterrupted run's."""
    import os
    import sys

    common = SIX
    checkpoint = tmp_path / "runs" / "faulty" / "version_0" / "checkpoints" / "last.ckpt"
    env = dict(
        os.environ,
        AMIR_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
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
        result = forks.run(
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
    faulty = policy(tmp_path, "faulty")
    for key in clean_six:
        assert torch.equal(clean_six[key], faulty[key]), key


def test_a_run_two_rollouts_ahead_with_pushes_in_flight_killed_mid_generation_resumes_to_the_same_weights(
    tmp_path, served
):
    """max_staleness 2 with partial_rollouts on a vLLM server, 5 rollouts: SIGKILL while the server runs rollout
    4's requests (sampled while rollout 2 trains). last.ckpt, written after rollout 1 (or 2 on a busy machine), holds
    the two rollouts sampled ahead whole; resumed from it, the run ends with the uninterrupted run's weights, bitwise.
    No rollout trains on weights older than two updates: the uninterrupted run's checkpoint after rollout 2 holds
    rollout 3 (the first weights') and rollout 4 (rollout 1's update's), scored, each token tagged with the weights
    that sampled it (each checkpoint waits for the rollouts in flight, so no push falls inside a generation there).
    The killed run starts its server, which goes with it; the uninterrupted and the resumed runs share one (``url``)."""
    import json

    server = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}
    common = ["fit", "--config", CONFIG, "--trainer.check_val_every_n_epoch", "50", "--trainer.max_epochs", "5"]
    common += ["--data.rollout.max_staleness", "2", "--data.rollout.partial_rollouts", "true"]
    common += ["--data.sampling.max_new_tokens", "12"]
    plain = served.tiny_yaml_engine()
    killing = json.dumps({"class_path": "server_runs.KillsMidGeneration", "init_args": {**server, "at_call": 4}})
    run_amir([*common, "--data.engine", plain, "--trainer.logger.init_args.name", "clean", "--checkpoint.save_top_k",
              "-1"], tmp_path)  # fmt: skip
    (second,) = (tmp_path / "runs" / "clean" / "version_0" / "checkpoints").glob("epoch=1-*.ckpt")
    ahead = torch.load(second, weights_only=True)["RolloutDataModule"]["pending"]["ranks"][0]
    assert [one["version"] for one in ahead] == [0, 1] and all(one["scores"] for one in ahead)
    assert all(c["versions"] == [one["version"]] * len(c["token_ids"])
               for one in ahead for group in one["completions"] for c in group)  # fmt: skip
    env = dict(
        os.environ,
        AMIR_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    named = ["--trainer.logger.init_args.name", "cut", "--trainer.logger.init_args.version", "0"]
    killed = forks.run(
        [sys.executable, "-m", "amir_lightning", *common, *named, "--data.engine", killing],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert killed.returncode == -9 and "test: SIGKILL with" in killed.stderr, killed.stderr[-3000:]
    server = started_server_pid(killed.stderr)
    assert count_after(server, set())[0] == 0  # the server it started, and its engine core, went with it
    checkpoint = tmp_path / "runs" / "cut" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)
    # Which checkpoint the kill finds depends on the machine's speed: after rollout 1 (rollouts 2 and 3 pending) on an
    # idle one, after rollout 2 on a busy one. Either holds the two rollouts sampling ahead, whole.
    assert saved["global_step"] in (1, 2) and len(saved["RolloutDataModule"]["pending"]["ranks"][0]) == 2
    run_amir([*common, *named, "--data.engine", plain, "--ckpt_path", str(checkpoint)], tmp_path)
    clean, resumed = policy(tmp_path, "clean"), policy(tmp_path, "cut")
    assert clean.keys() == resumed.keys()
    for key in clean:
        assert torch.equal(clean[key], resumed[key]), key


@pytest.mark.parametrize(("ahead", "versions"), [(2, [0, 1]), (3, [0, 0, 1])])
def test_a_checkpoint_between_an_epochs_draw_and_its_first_step_keeps_the_rollouts_older_weights_sampled(
    tmp_path, served, ahead, versions
):
    """max_staleness N (2, 3) with partial_rollouts: a checkpoint written as rollout 3 starts, after it took its
    rollout and before its first step (where SLURM's requeue signal or a SIGTERM can come), holds that rollout and the
    N - 1 that earlier epochs started, from older weights (``versions``); the one this epoch started is started again
    by the resumed run, from the same weights and seed. Resumed from it, the run ends with the uninterrupted run's
    weights, bitwise. Keeping only the rollout in training, the resumed run sampled the others again from newer
    weights: 2 (N 2) or 3 (N 3) of the later rollouts differed, their staleness 2 read 1."""
    cut = tmp_path / "cut.ckpt"
    common = ["fit", "--config", CONFIG, "--trainer.check_val_every_n_epoch", "50", "--trainer.max_epochs", "5"]
    common += ["--data.rollout.max_staleness", str(ahead), "--data.rollout.partial_rollouts", "true"]
    common += ["--data.sampling.max_new_tokens", "12", "--data.engine", served.tiny_yaml_engine()]
    env = dict(os.environ, PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    writes = ["--trainer.callbacks+=faults.CheckpointBeforeFirstStep", "--trainer.callbacks.epoch", "2"]
    writes += ["--trainer.callbacks.path", str(cut)]
    run_amir([*common, *writes, "--trainer.logger.init_args.name", "full"], tmp_path, env=env)
    state = torch.load(cut, weights_only=True)
    assert state["global_step"] == 2 and state["RolloutDataModule"]["rollout"]["steps_started"] == 0
    assert [one["version"] for one in state["RolloutDataModule"]["pending"]["ranks"][0]] == versions
    run_amir([*common, "--trainer.logger.init_args.name", "part", "--ckpt_path", str(cut)], tmp_path, env=env)
    full, part = policy(tmp_path, "full"), policy(tmp_path, "part")
    assert full.keys() == part.keys()
    for key in full:
        assert torch.equal(full[key], part[key]), key


def test_ctrl_c_stops_cleanly_and_leaves_a_loadable_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to the process group) while two workers grade: no traceback, no process left, last.ckpt whole."""
    import os
    import subprocess
    import sys

    env = dict(
        os.environ,
        AMIR_CACHE=str(tmp_path / "cache"),
        PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    args = ["fit", "--config", CONFIG, "--trainer.max_epochs", "6", "--trainer.check_val_every_n_epoch", "9"]
    args += ["--data.rewards", "[{class_path: faults.CtrlCDuringGrading, init_args: {at_call: 3, num_workers: 2}}]"]
    process = forks.Forked(
        [sys.executable, "-m", "amir_lightning", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        session=True,
        ctrl_c=True,
    )
    try:
        _, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
    assert process.returncode == 130, err[-3000:]  # after Lightning's graceful shutdown; 1 is a reward's error
    assert "Detected KeyboardInterrupt" in err and "Traceback" not in err, err[-3000:]
    alive = group_after(process.pid, within=5.0)  # a process still exiting as the run returns ("[python]") goes
    assert not alive, f"processes of the run still alive 5 s after it exited: {alive}"  # grading workers included
    checkpoint = torch.load(tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["state_dict"]  # the two finished rollouts, loadable


def test_a_slurm_requeue_resumes_from_its_checkpoint_with_ckpt_path_auto(tmp_path, clean_six):
    """SLURM's warning before it ends a job (``#SBATCH --signal=USR1@90``), here in the middle of rollout 3's
    generation: Lightning's auto-requeue writes hpc_ckpt_1.ckpt and asks ``scontrol`` to requeue the job, which ends
    it. The requeued job runs the same command with ``--ckpt_path auto``: it resumes from that checkpoint (newer than
    last.ckpt), logs into the same version folder, and ends with the weights of an uninterrupted run. ``scontrol`` is
    a script that records its arguments and ends the job, as SLURM's does (there is no SLURM here)."""
    import os
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `scontrol requeue` ends the running job and queues it again: the script records the call and ends the job.
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\nkill -KILL $PPID\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = str(HELPERS) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(SLURM_NTASKS="1", SLURM_JOB_NAME="amir", SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1")
    env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    args = [*SIX, "--ckpt_path", "auto"]
    warned = ["--data.engine", "faults.SignalDuringRollout", "--data.engine.init_args.at_call", "3"]
    warned += ["--data.engine.init_args.max_model_len", "64", "--data.engine.init_args.progress", "false"]
    warned += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432"]
    cmd = [sys.executable, "-m", "amir_lightning", *args, *warned]
    first = forks.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == -9, first.stderr[-3000:]  # ended by the requeue
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert torch.load(hpc, weights_only=True)["global_step"] == 2  # written during rollout 3

    result = run_amir(args, tmp_path, env=env)
    assert f"--ckpt_path auto: resuming from {hpc}" in result.stderr
    run = tmp_path / "runs" / "tiny"
    assert sorted(p.name for p in run.iterdir()) == ["version_0"]
    assert torch.load(run / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    requeued = policy(tmp_path, "tiny")
    for key in clean_six:
        assert torch.equal(clean_six[key], requeued[key]), key


def test_sigterm_is_a_clear_non_zero_exit_and_the_run_resumes_exactly(tmp_path, clean_six):
    """SIGTERM (what SLURM and Kubernetes send on preemption) in the middle of rollout 3's generation: the rollout
    finishes, its checkpoint is written, the run exits 143 with one line saying where it stopped and how to go on;
    the same command with ``--ckpt_path last`` ends with the weights of an uninterrupted run. Before: exit 0 and
    no message, so schedulers and ``amir fit && amir test`` read a preemption as success."""
    common = SIX
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(HELPERS))
    engine = ["--data.engine", "faults.SignalDuringRollout", "--data.engine.init_args.at_call", "3"]
    engine += ["--data.engine.init_args.signal_name", "SIGTERM", "--data.engine.init_args.max_model_len", "64"]
    engine += ["--data.engine.init_args.kv_cache_memory_bytes", "33554432", "--data.engine.init_args.progress", "false"]
    stopped = forks.run([sys.executable, "-m", "amir_lightning", *common, *engine], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = "runs/tiny/version_0/checkpoints/last.ckpt"
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"amir: stopped by SIGTERM with 3 of 6 rollouts done; the last checkpoint is {last}: resume with the same "
        "command and --ckpt_path last"
    )
    run_amir([*common, "--ckpt_path", "last"], tmp_path)
    resumed = policy(tmp_path, "tiny")
    for key in clean_six:
        assert torch.equal(clean_six[key], resumed[key]), key


def test_a_checkpoint_the_disk_refuses_is_one_line_and_leaves_nothing(tmp_path):
    """From rollout 2 on, files may not grow past 500 KB (RLIMIT_FSIZE; a checkpoint is 930 KB): the write fails as
    on a full disk. Before: three chained tracebacks whose last line named no path, and the partial file left."""
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(HELPERS))
    args = [*BASE, "--trainer.callbacks+=faults.FileSizeLimitFrom", "--trainer.callbacks.at_epoch", "1"]
    args += ["--trainer.callbacks.limit_bytes", "500000"]
    result = forks.run([sys.executable, "-m", "amir_lightning", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    line = f"amir: error: could not write the checkpoint {folder}/epoch=1-step=2.ckpt: File too large (the last one"
    assert line in result.stderr and "the partial file was removed, the previous checkpoint is intact" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 1


def test_a_closed_stdout_does_not_stop_the_run(tmp_path):
    """``amir fit ... | head -1``: the reader goes away, the run goes on and saves its checkpoints (before: the next
    print raised BrokenPipeError and the run ended with status 1 and no message)."""
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "amir_lightning", *BASE, "--trainer.enable_progress_bar", "true"]
    run = forks.Forked(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.readline()
    run.stdout.close()  # as `head -1` does
    stderr = run.communicate(timeout=600)[1].decode()
    assert run.returncode == 0, stderr[-3000:]
    checkpoint = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 2


def test_a_second_ctrl_c_exits_quietly(tmp_path):
    """Two Ctrl-C 50 ms apart while the run trains: before, the second one interrupted the shutdown that the first
    began, and garbage-collection callbacks printed "Exception ignored ... KeyboardInterrupt" tracebacks."""
    import signal
    import time

    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "amir_lightning", "fit", "--config", TINY, "--trainer.max_epochs", "500"]
    cmd += ["--trainer.check_val_every_n_epoch", "1000"]
    run = forks.Forked(cmd, cwd=tmp_path, env=env, session=True, ctrl_c=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)  # fmt: skip
    checkpoint = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)
    stderr = run.communicate(timeout=120)[1]
    assert run.returncode == 130, stderr[-3000:]  # not 1, the code of a reward's own error
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    torch.load(checkpoint, weights_only=True)  # whole
