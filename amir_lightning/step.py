"""Book-keeping of one optimisation step across its micro-batches and processes."""

from __future__ import annotations

import torch

from amir_lightning.distributed import all_reduce, sum_shares, world_size
from amir_lightning.objectives import INTENSIVE_STATS, GRPOLoss
from amir_lightning.rollout.batch import RolloutBatch

#: Where each loss stat is logged (TensorBoard groups by the first part).
STAT_KEYS = {
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "kl": "train/kl",
    "clip_frac": "train/clip_frac",
    "clip_frac_low": "train/clip_frac_low",
    "clip_frac_high": "train/clip_frac_high",
    "pg_scale": "train/pg_scale",
    "pair_loss": "amir/pair_loss",
    "pair_term": "amir/pair_term",
    "pair_grad": "amir/pair_grad",
    "lambda": "amir/lambda",
    "pair_acc": "amir/implicit_acc",  # z > 0, reference included; the PairMarginMonitor logs amir/pair_acc
    "engine_kl": "rollout/engine_trainer_kl",  # k3 KL(engine || trainer) per sampled token
    "is_weight_mean": "train/is_weight_mean",
    "is_capped_frac": "train/is_capped_frac",
}
#: Loss stats the PairMarginMonitor measures for GRPO and AMIR runs alike (under amir/...); not logged twice.
MONITORED_STATS = frozenset({"num_pairs", "pair_margin", "pair_reward_gap"})


def metric_names(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's loss stats under their logged names."""
    return {STAT_KEYS.get(k, f"train/{k}"): v for k, v in stats.items() if k not in MONITORED_STATS}


class StepAccumulator:
    """Global loss normalisers, summed stats and the "bad step" flag of the optimisation step in progress."""

    def __init__(self) -> None:
        self.norms: dict[str, float] | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.bad = False

    def normalizers(self, loss: GRPOLoss, batch: RolloutBatch, device: torch.device) -> dict[str, float]:
        """The step's normalisers over all processes, computed on its first micro-batch (a collective)."""
        if self.norms is None:
            local = loss.step_normalizers(
                batch.step_lengths, batch.step_rewards, batch.group_size, batch.step_truncated
            )
            self.norms = loss.global_normalizers(local, world_size(), lambda t, op: all_reduce(t, op, device))
        return self.norms

    def add(self, stats: dict[str, torch.Tensor], entropy: torch.Tensor | None, mask: torch.Tensor, ok: bool) -> None:
        """Accumulate a micro-batch's stats (its shares of the step); a non-finite micro-batch marks the step bad."""
        if not ok:
            self.bad = True
            return
        for key, value in stats.items():
            value = value.detach().float()
            self.stats[key] = value if key in INTENSIVE_STATS else self.stats.get(key, 0.0) + value
        if entropy is not None:
            share = (entropy * mask).sum() / max(self.norms["num_tokens"], 1.0)
            self.stats["entropy"] = self.stats.get("entropy", 0.0) + share

    def finish(self, device: torch.device, grad_norm: torch.Tensor) -> tuple[dict[str, torch.Tensor], bool]:
        """The step's stats summed over processes, and whether any process saw a non-finite loss or gradient."""
        bad = self.bad or not bool(torch.isfinite(grad_norm))
        bad = bool(all_reduce(torch.tensor([float(bad)]), "max", device)[0])
        stats = sum_shares(self.stats, INTENSIVE_STATS, device)
        self.norms, self.stats, self.bad = None, {}, False
        return stats, bad
