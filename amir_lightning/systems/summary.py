"""The shape of a run: its global step size, its length, whether a device's memory holds it.

``planned_steps`` is the run's length, which the LR schedule spans. The start-up summary is printed once, by the
global-zero process, when ``fit`` starts (``AmirGRPOModule.on_fit_start``). A user on an 8-GPU node sees that
``data.rollout.prompts_per_process`` counts per process (8 processes: 8x the batch), and a user on an 80 GB card sees
that the longest micro-batch's activations do not fit before the run finds out.

The activation estimate is ``1.08 * (10 H + 4 I)`` values per token and decoder layer in the compute dtype (H the
hidden size, I the MLP's), calibrated on ``benchmarks/activation_memory.py``'s count at Qwen2.5-3B's shape (0.133 MiB
per token and layer in bf16); with gradient checkpointing, one layer's worth plus each layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amir_lightning.helpers.sizes import format_bytes


@dataclass
class MemoryEstimate:
    """Bytes per device, estimated before the first step.

    Attributes:
        weights: The policy (frozen and trainable), gradients and AdamW state of the trainable part, and a reference
            copy, divided over the processes under FSDP2.
        activations: What the backward keeps for the largest micro-batch.
        engine: The rollout engine's share (vLLM's ``gpu_memory_utilization`` of the device).
        device: The device's memory; ``None`` on a CPU.
    """

    weights: float
    activations: float
    engine: float
    device: float | None

    @property
    def total(self) -> float:
        """Everything together."""
        return self.weights + self.activations + self.engine


def activation_bytes(config, tokens: int, dtype: torch.dtype, checkpointing: bool) -> float:
    """Estimated bytes the backward keeps for ``tokens`` tokens through a decoder of ``config``'s shape."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", 0)
    mlp = getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden
    layers = getattr(text, "num_hidden_layers", 1)
    per_layer = 1.08 * (10 * hidden + 4 * mlp) * torch.finfo(dtype).bits / 8 * tokens
    if checkpointing:  # each layer's input stays, one layer's activations are rebuilt at a time
        return per_layer + layers * hidden * torch.finfo(dtype).bits / 8 * tokens
    return layers * per_layer


def estimate_memory(module, data, processes: int, device_memory: float | None = None) -> MemoryEstimate:
    """``MemoryEstimate`` of the coming run from the module's policy and the data module's settings.

    ``device_memory``: the device's bytes (default: the CUDA device's; none on a CPU).
    """
    settings, sampling = data.settings, data.sampling
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in module.model.parameters())
    weights += trainable * 4 * 3  # float32 gradients and the two AdamW moments
    reference = module.policy.reference_copy
    weights += sum(p.numel() * p.element_size() for p in reference.parameters()) if reference is not None else 0
    if module.policy.sharded:
        weights /= processes
    rows = settings.micro_batch_groups * settings.group_size
    tokens = settings.micro_batch_tokens or rows * (data.prompt_limit + sampling.max_new_tokens)
    config = getattr(module.model, "config", None)
    activations = activation_bytes(config, tokens, module.compute_dtype, module.gradient_checkpointing) if config else 0
    device = module.device
    total = device_memory
    if total is None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    share = getattr(data.engine, "gpu_memory_utilization", 0.0) if total else 0.0
    return MemoryEstimate(float(weights), float(activations), float(share * total if total else 0.0), total)


def run_steps(trainer) -> int:
    """Optimisation steps of the run (-1: it has no set length).

    ``trainer.max_steps``, else ``trainer.max_epochs`` times a rollout's: its steps times its passes.
    """
    if trainer.max_steps and trainer.max_steps > 0:
        return trainer.max_steps
    if trainer.max_epochs is None or trainer.max_epochs < 0:
        return -1
    return trainer.max_epochs * run_steps_per_rollout(trainer)


def run_steps_per_rollout(trainer) -> int:
    """A rollout's optimisation steps: its steps times its passes (1 for a data module that is not ours)."""
    settings = getattr(trainer.datamodule, "settings", None)
    return settings.steps_per_rollout * settings.passes if settings is not None else 1


def run_rollouts(trainer) -> int | None:
    """Rollouts (epochs) of the run (``None``: it has no set length).

    ``trainer.max_epochs``, else as many as ``trainer.max_steps`` takes.
    """
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        return trainer.max_epochs
    steps = run_steps(trainer)
    return -(-steps // run_steps_per_rollout(trainer)) if steps > 0 else None


def planned_steps(trainer) -> int:
    """``run_steps``, which a run without a set length cannot give the LR schedule."""
    steps = run_steps(trainer)
    if steps <= 0:
        raise ValueError(
            "model.lr_scheduler.init_args.total_steps must be given when the run has no length "
            "(trainer.max_epochs and trainer.max_steps unset)"
        )
    return steps


def run_summary(trainer, module, data, device_memory: float | None = None) -> list[str]:
    """The lines of the start-up summary (``device_memory``: see ``estimate_memory``)."""
    processes, settings = trainer.world_size, data.settings
    per_step = settings.prompts_per_process // settings.steps_per_rollout
    steps = planned_steps(trainer) if trainer.max_epochs and trainer.max_epochs > 0 else None
    scheduler = getattr(module, "scheduler_factory", None)
    lines = [
        f"run: {processes} process{'es' if processes > 1 else ''} ({type(trainer.strategy).__name__}); every "
        f"optimiser step takes {per_step * processes} prompts x {settings.group_size} completions = "
        f"{per_step * processes * settings.group_size} completions ({per_step} prompts on each process, "
        "data.rollout.prompts_per_process); "
        f"{settings.steps_per_rollout} step(s) x {settings.passes} pass(es) per rollout, "
        + (f"{trainer.max_epochs} rollouts = {steps} optimiser steps" if steps else "no set length")
        + ("; the LR schedule spans them" if scheduler is not None and steps else "")
    ]
    memory = estimate_memory(module, data, processes, device_memory)
    checkpointing = "on" if module.gradient_checkpointing else "off"
    where = f"{module.device}" + (f", {format_bytes(memory.device)}" if memory.device else "")
    line = (
        f"memory per device ({where}): weights, gradients and optimiser state ~{format_bytes(memory.weights)}, "
        f"activations of the largest micro-batch ~{format_bytes(memory.activations)} (gradient checkpointing "
        f"{checkpointing})"
    )
    if memory.device:
        line += f", the engine's share {format_bytes(memory.engine)}: about {format_bytes(memory.total)} in all"
    lines.append(line)
    if memory.device and memory.total > 0.95 * memory.device:
        advice = (
            "set model.gradient_checkpointing: true"
            if not module.gradient_checkpointing
            else "lower data.rollout.micro_batch_groups or data.engine.init_args.gpu_memory_utilization"
        )
        lines.append(f"that is more than this device holds ({format_bytes(memory.device)}): {advice}")
    return lines
