"""Exact resume: a run of 4 rollouts and a run of 2 that is stopped and resumed for 2 more end identical."""

from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
CONFIG = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


def test_stopped_and_resumed_run_matches_the_uninterrupted_one(tmp_path):
    common = ["fit", "--config", CONFIG, "--trainer.deterministic", "true", "--trainer.check_val_every_n_epoch", "3"]
    run_amir([*common, "--trainer.max_epochs", "4", "--trainer.logger.init_args.name", "full"], tmp_path)
    run_amir([*common, "--trainer.max_epochs", "2", "--trainer.logger.init_args.name", "part"], tmp_path)
    checkpoint = tmp_path / "runs" / "part" / "version_0" / "checkpoints" / "last.ckpt"
    run_amir(
        [
            *common,
            "--trainer.max_epochs",
            "4",
            "--trainer.logger.init_args.name",
            "part",
            "--ckpt_path",
            str(checkpoint),
        ],
        tmp_path,
    )
    full = load_file(tmp_path / "runs" / "full" / "version_0" / "policy" / "model.safetensors")
    resumed = load_file(tmp_path / "runs" / "part" / "version_1" / "policy" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    whole = read_scalars(tmp_path / "runs" / "full" / "version_0")
    halves = read_scalars(tmp_path / "runs" / "part" / "version_0")
    rest = read_scalars(tmp_path / "runs" / "part" / "version_1")
    assert halves["rollout/reward_mean"] + rest["rollout/reward_mean"] == whole["rollout/reward_mean"]
    assert halves["amir/lambda"] + rest["amir/lambda"] == whole["amir/lambda"]
