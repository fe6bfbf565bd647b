"""LengthBiasMonitor: the length-bias and penalty-dilution numbers the AMIR-GRPO paper argues about (arXiv 2601.03661).

Per optimisation step:
- ``length/correct_mean``, ``length/incorrect_mean`` and their gap ``length/gap`` (incorrect minus correct): the
  length-bias story predicts wrong answers growing longer under GRPO;
- ``length/corr_advantage``: the within-group Spearman correlation of length with advantage, averaged over groups
  where both vary;
- ``length/neg_token_weight_pg``: the mean per-token gradient weight a negative-advantage completion gets from the
  policy-gradient term under the loss's aggregation (``|A| / (N |o|)`` for ``grpo``: diluted by length), and,
  for AMIR-GRPO, ``length/neg_token_weight_pair``, the per-token push-down of the pair term on the same
  completions (``lambda beta / P * sum_i sigmoid(-z_ij) / |o_j|``), and their ratio ``length/pair_to_pg``. Both
  weights are the loss's own diagnostics (``LossOutput.rows``), computed with the step's normalisers and lambda;
- with ``long_tokens``, ``length/long_incorrect_frac``: the share of the step's graded completions that are wrong
  and longer than ``long_tokens``, the sampled estimate of the probability the policy gives to long wrong answers;
- histograms of correct and incorrect lengths. (The truncation rate is ``length/truncated_frac`` of the rollout.)

The paper defines no length metric; these are this project's.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from amir_lightning.callbacks._base import StepMonitor, micro_batches
from amir_lightning.helpers.tracking import log_histogram, log_metrics


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks along the last dimension (ties share their mean rank)."""
    order = x.argsort(dim=-1)
    ranks = torch.empty_like(x)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(x))
    equal = x.unsqueeze(-1) == x.unsqueeze(-2)  # [..., G, G]
    return (equal.to(x.dtype) @ ranks.unsqueeze(-1)).squeeze(-1) / equal.sum(-1)


def spearman_per_group(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman correlation of ``x`` and ``y`` ``[B, G]`` per group; NaN where either is constant."""
    rx, ry = _ranks(x.float()), _ranks(y.float())
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    denom = (rx.square().sum(-1) * ry.square().sum(-1)).sqrt()
    return torch.where(denom > 0, (rx * ry).sum(-1) / denom.clamp(min=1e-12), torch.nan)


class LengthBiasMonitor(StepMonitor):
    """Length statistics of correct and incorrect completions and the per-token weights of the penalties.

    Args:
        histogram: Write length histograms (``length/hist_correct``, ``length/hist_incorrect``).
        long_tokens: Log ``length/long_incorrect_frac``, the share of wrong completions longer than this many tokens.
    """

    def __init__(self, histogram: bool = True, long_tokens: int | None = None) -> None:
        means = ["correct", "incorrect", "corr_advantage", "neg_pg", "neg_pair"]
        super().__init__(means + ["long_incorrect"] * (long_tokens is not None), ["hist_correct", "hist_incorrect"])
        self.write_histogram, self.long_tokens = histogram, long_tokens

    @override
    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for micro, rows in micro_batches(outputs, batch):
            self._add(micro, rows)
        self._flush(trainer, pl_module)

    def _add(self, batch, rows) -> None:
        G = batch.group_size
        lengths = batch.completion_mask.sum(-1)  # [n]
        correct = batch.correct
        known = ~correct.isnan()
        self.mean("correct", lengths[known & (correct == 1)])
        self.mean("incorrect", lengths[known & (correct == 0)])
        self.cat("hist_correct", lengths[known & (correct == 1)])
        self.cat("hist_incorrect", lengths[known & (correct == 0)])
        if self.long_tokens is not None:
            self.mean("long_incorrect", ((lengths > self.long_tokens) & (correct == 0)).float()[known])
        self.mean("corr_advantage", spearman_per_group(lengths.view(-1, G), batch.advantages.view(-1, G)))
        negative = batch.advantages < 0
        self.mean("neg_pg", rows.pg_token_weight[negative])
        if rows.pair_push is not None:
            self.mean("neg_pair", rows.pair_push[negative])

    def _flush(self, trainer, pl_module) -> None:
        means, cats = self.computed()
        logged = {}
        if "correct" in means:
            logged["length/correct_mean"] = means["correct"]
        if "incorrect" in means:
            logged["length/incorrect_mean"] = means["incorrect"]
        if "correct" in means and "incorrect" in means:
            logged["length/gap"] = means["incorrect"] - means["correct"]
        if "long_incorrect" in means:
            logged["length/long_incorrect_frac"] = means["long_incorrect"]
        if "corr_advantage" in means and not means["corr_advantage"].isnan():
            logged["length/corr_advantage"] = means["corr_advantage"]
        if "neg_pg" in means:
            logged["length/neg_token_weight_pg"] = means["neg_pg"]
        if "neg_pair" in means:
            logged["length/neg_token_weight_pair"] = means["neg_pair"]
            logged["length/pair_to_pg"] = means["neg_pair"] / means["neg_pg"].clamp(min=1e-12)
        if logged:
            log_metrics(trainer, logged)
        if self.write_histogram:
            log_histogram(trainer, "length/hist_correct", cats.get("hist_correct", torch.zeros(0)))
            log_histogram(trainer, "length/hist_incorrect", cats.get("hist_incorrect", torch.zeros(0)))
