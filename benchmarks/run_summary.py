"""The start-up summary of ``configs/qwen.yaml`` on emulated GPUs: 1 and 8 processes, an 80 GB and a 141 GB card.

    python benchmarks/run_summary.py [--processes 1 8] [--device-gb 80 141] [--checkpointing true false]

The configuration is parsed as ``amir fit`` parses it (with a local GSM8K sample for the prompts); the policy is
Qwen2.5-3B-Instruct's shape with qwen.yaml's LoRA, built on the meta device (no weights, no download), and the
device's memory is given instead of read from a GPU. Each case prints the lines ``amir fit`` prints when the run
starts (``amir_lightning/systems/summary.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from amir_lightning.cli import build_cli
from amir_lightning.models import QWEN25_3B_SHAPE
from amir_lightning.systems.summary import run_summary

ROOT = Path(__file__).parents[1]
PROMPTS = ROOT / "tests" / "fixtures" / "gsm8k_sample.jsonl"  # the hub's GSM8K is not needed for the summary


def meta_policy(lora):
    """Qwen2.5-3B's shape in bf16 with qwen.yaml's adapters, on the meta device."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = QWEN25_3B_SHAPE
    config = Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        target = "all-linear" if lora.target_modules == "all-linear" else list(lora.target_modules)
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=target))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = torch.empty(param.shape, dtype=torch.float32, device="meta")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device-gb", type=float, nargs="+", default=[80, 141])
    parser.add_argument("--checkpointing", nargs="+", default=["true", "false"])
    args = parser.parse_args()
    sys.argv = sys.argv[:1]  # the CLI below reads its own arguments
    logging.disable(logging.WARNING)
    for checkpointing in args.checkpointing:
        local = json.dumps({"class_path": "amir_lightning.data.JsonlPrompts", "init_args": {"path": str(PROMPTS)}})
        given = ["--config", str(ROOT / "configs" / "qwen.yaml"), "--model.gradient_checkpointing", checkpointing]
        given += ["--trainer.accelerator", "cpu", "--trainer.strategy", "auto"]  # no GPU here: the trainer is faked
        cli = build_cli([*given, "--data.prompts", local, "--data.val_prompts", local], run=False)
        module, data = cli.model, cli.datamodule
        module.model, module.compute_dtype, module.policy.sharded = meta_policy(module.lora), torch.bfloat16, True
        module._device = torch.device("cuda", 0)
        for processes in args.processes:
            trainer = SimpleNamespace(
                world_size=processes, max_epochs=1000, max_steps=-1, datamodule=data,
                strategy=type("ModelParallelStrategy", (), {})(),
            )  # fmt: skip
            module._trainer = trainer
            for gigabytes in args.device_gb:
                case = f"gradient checkpointing {checkpointing}, {processes} process(es), {gigabytes:g} GB"
                print(f"\nqwen.yaml, {case}:")
                for line in run_summary(trainer, module, data, device_memory=gigabytes * 1e9):
                    print(f"    {line}")


if __name__ == "__main__":
    main()
