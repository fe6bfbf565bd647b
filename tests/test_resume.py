"""Exact resume: a run of 4 rollouts and a run of 2 that is stopped and resumed for 2 more end identical.

The runs are ``amir fit`` in this process with the HF engine (``run_here``); runs stopped from outside (SIGKILL,
SIGTERM, Ctrl-C, SLURM's requeue) resume with vLLM in processes of their own in ``tests/e2e/test_stops.py``.
"""

from pathlib import Path

import pytest
import torch
from conftest import HF_ENGINE, read_scalars, run_here, stop_and_resume

pytestmark = pytest.mark.slow
CONFIG = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


@pytest.fixture
def amir(tmp_path, monkeypatch, capsys, caplog):
    """``amir(args, where=tmp_path, expect=0)``: the CLI run here, with the HF engine."""
    return lambda args, where=tmp_path, expect=0: run_here([*args, *HF_ENGINE], where, monkeypatch, capsys, caplog,
                                                          expect)  # fmt: skip


def test_stopped_and_resumed_run_matches_the_uninterrupted_one(amir, tmp_path):
    common = ["fit", "--config", CONFIG, "--trainer.deterministic", "true", "--trainer.check_val_every_n_epoch", "3"]
    stop_and_resume(amir, tmp_path, common)
    whole = read_scalars(tmp_path / "runs" / "full" / "version_0")
    halves = read_scalars(tmp_path / "runs" / "part" / "version_0")
    rest = read_scalars(tmp_path / "runs" / "part" / "version_1")
    assert halves["rollout/reward_mean"] + rest["rollout/reward_mean"] == whole["rollout/reward_mean"]
    assert halves["amir/lambda"] + rest["amir/lambda"] == whole["amir/lambda"]


LORA = ["--model.lora", "{r: 4, alpha: 8, target_modules: all-linear}"]


def test_lora_checkpoints_hold_the_adapters_and_resume_exactly(amir, tmp_path):
    """LoRA: last.ckpt holds the adapters, optimiser and loop state and the base model's identity, not the base
    weights; a stopped and resumed run still ends identical; resuming on another base model is refused. (Before,
    the first run built the tiny model, which reseeded the global RNG that LoRA's adapter init draws from; the
    resumed run found the model cached: other adapters, weights 0.05 apart with the HF engine. vLLM's start reseeds
    that RNG, which hid it there.)"""
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
    checkpoint = stop_and_resume(amir, tmp_path, common, first_half=adapters)
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
    other_base = ["--trainer.max_epochs", "4", "--ckpt_path", str(checkpoint), "--model.policy.init_args.seed", "1"]
    result = amir([*common, *other_base], expect=2)  # bad input: one line, as every other
    assert "holds LoRA adapters trained on the base model" in result.stderr and "weights differ" in result.stderr
    assert "Traceback" not in result.stderr


def test_restarting_the_same_command_with_ckpt_path_last_continues_the_run_and_its_curves(amir, tmp_path):
    """A job stopped after 3 rollouts and started again with ``--ckpt_path last`` (what a preempted or requeued job
    does) continues at rollout 4 in the same version folder, so every curve is one; each rollout writes one
    checkpoint, which last.ckpt links to. ``last`` with nothing to resume is one line; ``auto`` then starts fresh."""
    common = ["fit", "--config", CONFIG, "--trainer.check_val_every_n_epoch", "50"]
    amir([*common, "--trainer.max_epochs", "3"])
    result = amir([*common, "--trainer.max_epochs", "6", "--ckpt_path", "last"])
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
    failed = amir([*common, "--trainer.max_epochs", "1", "--ckpt_path", "last"], where=fresh, expect=2)
    assert "amir: error: --ckpt_path last: no last.ckpt in runs/tiny/version_*/checkpoints" in failed.stderr
    amir([*common, "--trainer.max_epochs", "1", "--ckpt_path", "auto"], where=fresh)
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
    common += HF_ENGINE
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
