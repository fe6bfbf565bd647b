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


def test_lora_with_the_hf_engine_resumes_exactly(amir, tmp_path):
    """The LoRA resume of ``tests/e2e/test_stops.py`` with the HF engine, whose start leaves the global random state
    alone. Before, the first run built the tiny model, which reseeded that state before LoRA's adapters were drawn;
    the resumed run found the model cached: other adapters, rollout 3 sampled otherwise, weights 0.05 apart."""
    common = ["fit", "--config", CONFIG, *LORA, "--trainer.deterministic", "true"]
    stop_and_resume(amir, tmp_path, [*common, "--trainer.check_val_every_n_epoch", "9"])


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
