"""Learning-rate schedules for LightningCLI (``model.lr_scheduler``), stepped once per optimisation step."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override


class WarmupCosineLR(LambdaLR):
    """Linear warm-up to the base LR, then cosine decay to ``min_ratio`` of it (TRL/HF ``cosine`` with warm-up).

    Args:
        optimizer: The optimizer (injected by LightningCLI).
        total_steps: Optimisation steps of the run; ``None`` (default): the run's own, which ``AmirGRPOModule`` sets
            from ``trainer.max_steps``, or ``trainer.max_epochs`` times the steps of a rollout, so that changing
            the run's length (also on resume) stretches the schedule instead of cutting it or holding it at zero.
        warmup_ratio: Share of ``total_steps`` spent warming up (the official runs: 0.1).
        min_ratio: Final LR as a fraction of the base LR.
    """

    def __init__(
        self, optimizer: Optimizer, total_steps: int | None = None, warmup_ratio: float = 0.1, min_ratio: float = 0.0
    ):
        if (total_steps is not None and total_steps < 1) or not 0 <= warmup_ratio < 1 or not 0 <= min_ratio <= 1:
            raise ValueError(
                "model.lr_scheduler needs total_steps >= 1 (or null), 0 <= warmup_ratio < 1, 0 <= min_ratio <= 1; "
                f"got {total_steps}, {warmup_ratio}, {min_ratio}"
            )
        self.total_steps, self.warmup_ratio, self.min_ratio = total_steps, warmup_ratio, min_ratio
        self.from_run = total_steps is None
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        """The LR multiplier at ``step``."""
        total = self.total_steps or 1
        warmup = int(total * self.warmup_ratio)
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def set_total_steps(self, total_steps: int) -> None:
        """Fix the run's length (``total_steps`` was ``None``) and the LR of the current step with it."""
        self.total_steps = total_steps
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.factor(self.last_epoch)

    @override
    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the position; a length taken from the run stays this run's (the run may have grown)."""
        total, from_run = self.total_steps, self.from_run
        super().load_state_dict({**state_dict, "lr_lambdas": [None]})
        if from_run and total is not None:
            self.from_run = True
            self.set_total_steps(total)
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
