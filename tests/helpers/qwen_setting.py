"""``configs/qwen.yaml`` with only the model, the prompts and the accelerator overridden.

The same arguments run on 2 CPU processes in the suite (tests/e2e/test_distributed.py) and on one GPU
(tests/gpu/test_gpu.py): the paper's setting is the code path CI exercises.
"""

import json
from pathlib import Path

ROOT = Path(__file__).parents[2]
PROMPTS = ROOT / "tests" / "fixtures" / "gsm8k_sample.jsonl"


def tiny_policy(**shape) -> dict:
    """A random Qwen2 with a printable-ASCII character tokenizer (GSM8K questions and the system prompt fit)."""
    from amir_lightning.models import PRINTABLE_ALPHABET

    init = {"alphabet": PRINTABLE_ALPHABET, "max_position_embeddings": 2048, **shape}
    return {"class_path": "amir_lightning.models.TinyModel", "init_args": init}


def qwen_setting_args(policy: dict, accelerator: str, devices: int, rollouts: int = 3, extra=()) -> list[str]:
    """``amir fit`` arguments: qwen.yaml, then the model, local GSM8K prompts and the accelerator."""
    prompts = json.dumps({"class_path": "amir_lightning.data.JsonlPrompts", "init_args": {"path": str(PROMPTS)}})
    return [
        "fit",
        "--config",
        str(ROOT / "configs" / "qwen.yaml"),
        "--model.policy",
        json.dumps(policy),
        "--data.prompts",
        prompts,
        "--data.val_prompts",
        prompts,
        "--trainer.accelerator",
        accelerator,
        "--trainer.devices",
        str(devices),
        "--trainer.max_epochs",
        str(rollouts),
        *extra,
    ]


def check_qwen_run(log_dir: Path, rollouts: int) -> None:
    """What every run of the setting must show: verified syncs, finite steps, an export that loads."""
    import torch
    from conftest import read_scalars
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scalars = read_scalars(log_dir)
    assert len(scalars["rollout/reward_mean"]) == rollouts and len(scalars["train/loss"]) == rollouts
    # every sync compared the engine's weights with the pushed ones (a mismatch stops the run), and was probed
    assert scalars["rollout/sync_verified_tensors"] and min(scalars["rollout/sync_verified_tensors"]) > 0
    assert all(torch.isfinite(torch.tensor(scalars["rollout/sync_logp_diff"])))
    assert all(torch.isfinite(torch.tensor(scalars["train/grad_norm"])))
    assert len(scalars["rollout/engine_trainer_kl"]) == rollouts
    export = log_dir / "policy"
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits.float()).all()
