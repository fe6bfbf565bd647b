"""PairMarginMonitor: the length-normalised log-prob margin of mined pairs under the current policy (Figure 4).

For every pair (chosen, rejected) of a group, ``margin = l(chosen) - l(rejected)`` with ``l`` the mean token
log-prob (at the training temperature) from the training forward pass, so measuring costs no forward. Pairs are
the loss's own when it is an ``AmirGRPOLoss``; for GRPO runs they are mined for measurement only, so GRPO and
AMIR runs log the same keys.
"""

from __future__ import annotations

import torch

from amir_lightning.callbacks._base import StepMonitor, histogram
from amir_lightning.objectives import AmirGRPOLoss, mine_pairs, sequence_logps
from amir_lightning.tracking import log_metrics


class PairMarginMonitor(StepMonitor):
    """Per step: margin mean and median, share of pairs with a positive margin, pair count, histogram.

    Keys: ``amir/pair_margin``, ``amir/pair_margin_median``, ``amir/pair_acc``, ``amir/num_pairs``,
    ``amir/pair_reward_gap``, and the histogram ``amir/pair_margin_hist``.

    Args:
        margin: Reward margin for mining; ``None`` takes the AMIR loss's (0.0 for GRPO runs).
        pair_mode: ``all`` or ``top1``; ``None`` takes the AMIR loss's (``all`` for GRPO runs).
        max_pairs_per_group: Pair cap; ``None`` takes the AMIR loss's (no cap for GRPO runs).
        histogram: Write the margin histogram.
    """

    def __init__(
        self,
        margin: float | None = None,
        pair_mode: str | None = None,
        max_pairs_per_group: int | None = None,
        histogram: bool = True,
    ) -> None:
        super().__init__()
        self.margin, self.pair_mode, self.max_pairs_per_group = margin, pair_mode, max_pairs_per_group
        self.write_histogram = histogram

    def _mining(self, pl_module) -> tuple[float, str, int | None]:
        loss = getattr(pl_module, "loss", None)
        if isinstance(loss, AmirGRPOLoss):
            defaults = (loss.margin, loss.pair_mode, loss.max_pairs_per_group)
        else:
            defaults = (0.0, "all", None)
        return (
            defaults[0] if self.margin is None else self.margin,
            defaults[1] if self.pair_mode is None else self.pair_mode,
            defaults[2] if self.max_pairs_per_group is None else self.max_pairs_per_group,
        )

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        if not isinstance(outputs, dict) or "logps" not in outputs:
            return
        margin, mode, cap = self._mining(pl_module)
        seq = sequence_logps(outputs["logps"].float(), batch.completion_mask, "mean")  # [n]
        pairs = mine_pairs(batch.rewards, batch.group_size, margin, mode, cap)  # [P, 2]
        margins = seq[pairs[:, 0]] - seq[pairs[:, 1]]  # [P]
        self.cat("margins", margins)
        self.mean("reward_gap", batch.rewards[pairs[:, 0]] - batch.rewards[pairs[:, 1]])
        self.sum("num_pairs", len(pairs), seq.device)
        if batch.last_in_step:
            self._flush(trainer, pl_module)

    def _flush(self, trainer, pl_module) -> None:
        means, cats = self.computed()
        margins = cats.get("margins", torch.zeros(0))
        logged = {"amir/num_pairs": means["num_pairs"].float()}
        if margins.numel():
            logged.update(
                {
                    "amir/pair_margin": margins.mean(),
                    "amir/pair_margin_median": margins.median(),
                    "amir/pair_acc": (margins > 0).float().mean(),
                    "amir/pair_reward_gap": means["reward_gap"],
                }
            )
        log_metrics(trainer, logged)
        if self.write_histogram:
            histogram(trainer, "amir/pair_margin_hist", margins)
