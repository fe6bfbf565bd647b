"""On one CUDA GPU: the paper's setting (configs/qwen.yaml) at the paper's model size, and a tiny FSDP2 run that learns.

Skipped without CUDA. No vLLM and no hub are needed: the rollout engine is ``HFEngine`` and the models are random
(a Qwen2.5-3B-shaped one built from its config). Sized to finish in under 5 minutes on one H200; docs/gpu.md says
how to run them on a bare CUDA machine with no internet.
"""

import json
from pathlib import Path

import pytest
from conftest import read_scalars, run_amir
from helpers.qwen_setting import check_qwen_run, qwen_setting_args, tiny_policy

from amir_lightning.models import QWEN25_3B_SHAPE

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).parents[2]


def hf_engine(batch_size: int) -> str:
    init = {"dtype": "bfloat16", "batch_size": batch_size, "progress": False}
    return json.dumps({"class_path": "amir_lightning.rollout.HFEngine", "init_args": init})


def test_qwen_setting_at_the_paper_size(tmp_path):
    """qwen.yaml (FSDP2, bf16 compute with float32 LoRA adapters, gradient checkpointing, calibrated sync check) on a
    random model of Qwen2.5-3B's shape: 3 rollouts of 4 prompts x 8, every sync within tolerance, the export loads."""
    policy = tiny_policy(**QWEN25_3B_SHAPE, dtype="bfloat16")
    extra = ["--data.engine", hf_engine(32), "--data.sampling.max_new_tokens", "128"]
    run_amir(qwen_setting_args(policy, "gpu", 1, rollouts=3, extra=extra), tmp_path, timeout=420)
    check_qwen_run(tmp_path / "runs" / "qwen" / "version_0", rollouts=3)


def test_tiny_fsdp2_run_learns(tmp_path):
    """configs/tiny.yaml under ModelParallelStrategy (FSDP2) on one GPU: the copy-a-digit reward rises."""
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.accelerator",
        "gpu",
        "--trainer.strategy",
        "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}",
        "--data.engine",
        hf_engine(128),
        "--trainer.max_epochs",
        "20",
    ]
    run_amir(args, tmp_path, timeout=300)
    rewards = read_scalars(tmp_path / "runs" / "tiny" / "version_0")["rollout/reward_mean"]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.1
