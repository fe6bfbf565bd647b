"""PairMarginMonitor: the length-normalised log-prob margins of mined pairs under the current policy (Figure 4).

For every pair (chosen, rejected) of a group, ``margin = l(chosen) - l(rejected)`` with ``l`` the mean token
log-prob (at the training temperature) from the training forward pass, so measuring costs no forward. The pairs
and ``l`` are the loss's own diagnostics (``LossOutput.rows``): an ``AmirGRPOLoss`` mines with its settings, GRPO
with the default rule, for measurement. The loss's stats already log the pooled ``amir/pair_margin``,
``amir/pair_acc``, ``amir/num_pairs`` and ``amir/pair_reward_gap`` every step; this monitor adds what needs the
whole distribution.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from amir_lightning.callbacks._base import StepMonitor, micro_batches
from amir_lightning.helpers.tracking import log_histogram, log_metrics


class PairMarginMonitor(StepMonitor):
    """Per step: the median pair margin (``amir/pair_margin_median``) and the histogram ``amir/pair_margin_hist``.

    Args:
        histogram: Write the margin histogram.
    """

    def __init__(self, histogram: bool = True) -> None:
        super().__init__(cats=["margins"])
        self.write_histogram = histogram

    @override
    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for _, rows in micro_batches(outputs, batch):
            self.cat("margins", rows.seq_logps[rows.pairs[:, 0]] - rows.seq_logps[rows.pairs[:, 1]])
        _, cats = self.computed()
        margins = cats.get("margins", torch.zeros(0))
        if margins.numel():
            log_metrics(trainer, {"amir/pair_margin_median": margins.median()})
        if self.write_histogram:
            log_histogram(trainer, "amir/pair_margin_hist", margins)
