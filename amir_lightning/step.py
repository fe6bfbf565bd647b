"""Book-keeping of one optimisation step across its micro-batches and processes."""

from __future__ import annotations

import torch

from amir_lightning.distributed import all_reduce, sum_shares, world_size
from amir_lightning.objectives import GRPOLoss, StepContext
from amir_lightning.rollout.batch import RolloutBatch


class StepAccumulator:
    """The ``StepContext``, summed stats and "bad step" flag of the optimisation step in progress.

    Every stat an objective returns is its micro-batch's share of the step, so the step's value is the sum over
    micro-batches and processes; the context (normalisers, pair count, lambda) is computed once, on the step's first
    micro-batch.
    """

    def __init__(self) -> None:
        self.context: StepContext | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.bad = False

    def context_of(self, loss: GRPOLoss, batch: RolloutBatch, device: torch.device) -> StepContext:
        """The step's context over all processes (a collective on the step's first micro-batch)."""
        if self.context is None:
            self.context = loss.step_context(
                batch.step_lengths,
                batch.step_rewards,
                batch.group_size,
                batch.step_truncated,
                world_size(),
                lambda t, op: all_reduce(t, op, device),
            )
        return self.context

    def add(self, stats: dict[str, torch.Tensor], ok: bool) -> None:
        """Accumulate a micro-batch's stats (its shares of the step); a non-finite micro-batch marks the step bad."""
        if not ok:
            self.bad = True
            return
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0.0) + value.detach().float()

    def finish(self, device: torch.device, grad_norm: torch.Tensor) -> tuple[dict[str, torch.Tensor], bool]:
        """The step's stats summed over processes, and whether any process saw a non-finite loss or gradient."""
        bad = self.bad or not bool(torch.isfinite(grad_norm))
        bad = bool(all_reduce(torch.tensor([float(bad)]), "max", device)[0])
        stats = sum_shares(self.stats, device)
        self.context, self.stats, self.bad = None, {}, False
        return stats, bad
