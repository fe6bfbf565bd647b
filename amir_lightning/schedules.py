"""Learning-rate schedules for LightningCLI (``model.lr_scheduler``), stepped once per optimisation step."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosineLR(LambdaLR):
    """Linear warm-up to the base LR, then cosine decay to ``min_ratio`` of it (TRL/HF ``cosine`` with warm-up).

    Args:
        optimizer: The optimizer (injected by LightningCLI).
        total_steps: Optimisation steps of the run.
        warmup_ratio: Share of ``total_steps`` spent warming up (the official runs: 0.1).
        min_ratio: Final LR as a fraction of the base LR.
    """

    def __init__(self, optimizer: Optimizer, total_steps: int, warmup_ratio: float = 0.1, min_ratio: float = 0.0):
        if total_steps < 1 or not 0 <= warmup_ratio < 1 or not 0 <= min_ratio <= 1:
            raise ValueError(
                "model.lr_scheduler needs total_steps >= 1, 0 <= warmup_ratio < 1, 0 <= min_ratio <= 1; got "
                f"{total_steps}, {warmup_ratio}, {min_ratio}"
            )
        warmup = int(total_steps * warmup_ratio)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        super().__init__(optimizer, factor)
