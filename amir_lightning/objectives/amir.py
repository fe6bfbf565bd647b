"""AMIR-GRPO: GRPO plus an implicit preference term mined from each group's reward ranking (arXiv 2601.03661).

    loss = L_GRPO + lambda * L_pref
    L_pref = -(1 / P_step) sum_{(i, j) in S} log sigmoid(beta_pair * [(l_i - lref_i) - (l_j - lref_j)])
    S = {(i, j) same group : r_i - r_j > margin}

``l`` comes from the token log-probs of the GRPO forward pass: no second forward, ever.

The adaptive lambda schedule keeps the pair term's pull at a set share of the policy gradient's: once per step,
with ``rho = lambda * |grad L_pref| / M``, lambda is multiplied by ``lambda_up`` when ``rho < ratio_low`` and by
``lambda_down`` when ``rho > ratio_high``, then clamped to ``[lambda_min, lambda_max]``. ``|grad L_pref|`` is the
gradient mass of the pair loss on the token log-probs (``sum_it |dL_pref / d logp_it|``, the ``pair_grad`` stat)
and ``M`` an exponential moving average of the policy gradient's (``pg_scale``, ``agg(|min(rho A, clip A)|)``).

Deliberate deviations from the official controller (AmirHosseinYari2002/AMIR-GRPO, Train/trainer.py), which
compares ``lambda * L_pref`` with the signed GRPO loss, band 0.30-0.70, x1.25 / x0.8, bounds 0.005-0.05:
- The official band cannot be met inside the official bounds. On-policy the signed GRPO loss is ``-mean(A) + beta
  KL``, about zero with a random sign, so its ratio explodes or flips and lambda random-walks. Against the
  policy-gradient magnitude instead, ``L_pref`` stays near log 2 (``pair_beta`` 0.2 keeps ``z`` small) and the
  band needs lambda 0.35-0.9; measured in ``make demo``, lambda sat at ``lambda_max`` for all 12 steps.
- So the statistic is the gradient share ``rho`` and the default band 0.005-0.015: the pair term pulls 0.5-1.5 %
  as hard as the policy gradient, which is where the official lambda range puts it. Measured in ``make demo``
  (tests/fixtures/demo_lambda_stats.json): ``|grad L_pref|`` stays at 0.18-0.19 (a mean over pairs) while ``M``
  falls from 0.8 to 0.08 as groups lose reward variance, so the pair term's share grows tenfold unless lambda
  follows. Replayed on those statistics, lambda goes 0.05 -> 0.04 -> 0.032 from the demo's start and 0.01 ->
  0.0195 from qwen.yaml's, off its bounds at every step (tests/test_lambda_schedule.py).
- lambda is updated once per optimisation step, after it, from the step's pooled values, and used from the next
  step: the gradient of a step then does not depend on how it was split into micro-batches (the official code
  compares the full pair loss with one micro-batch's GRPO loss).
- The clamp to ``[lambda_min, lambda_max]`` applies on every update, so an initial lambda outside the bounds is
  pulled in.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from amir_lightning.objectives.pairs import PairMode, mine_pairs, pair_mask_and_gaps
from amir_lightning.objectives.policy import (
    Aggregation,
    GRPOLoss,
    ImportanceSampling,
    LossOutput,
    SamplingCorrection,
)
from amir_lightning.validation import check_number, raise_errors

#: Where these arguments live in a YAML config, for error messages.
_KEY = "model.loss.init_args"
LambdaSchedule = Literal["fixed", "adaptive"]


class AmirGRPOLoss(GRPOLoss):
    """GRPO loss plus the AMIR pairwise preference term; takes every ``GRPOLoss`` argument too.

    Args:
        aggregation: GRPO token aggregation (see ``GRPOLoss``).
        epsilon: Lower clip range.
        epsilon_high: Upper clip range; defaults to ``epsilon``.
        importance_sampling: ``token`` or ``sequence`` ratios.
        beta: KL coefficient of the GRPO term (k3 to the reference).
        mask_truncated_completions: Drop truncated completions from the GRPO term (the pair term keeps them: a
            truncated low-reward completion is a legitimate rejected sample).
        max_completion_length: ``L`` of ``dr_grpo``.
        sampling_correction: Importance weights for the engine/trainer mismatch (``GRPOLoss``); not applied to the
            pair term.
        sampling_cap: Largest importance weight kept.
        lambda_: Initial (or fixed) weight of the pair term.
        pair_beta: Inverse temperature ``beta_dpo`` of the pair logistic.
        margin: Reward gap a pair needs, strictly: ``r_chosen - r_rejected > margin``.
        pair_mode: ``all`` pairs or ``top1`` (best of group against the rest).
        max_pairs_per_group: Keep at most this many pairs per group, the largest reward gaps first.
        reduction: Sequence log-prob ``mean`` (length-normalised, official) or ``sum`` (first official commit).
        reference_free: Use ``l_ref = 0`` (every official run did); ``False`` needs a reference model.
        lambda_schedule: ``fixed`` or ``adaptive`` (module docstring).
        lambda_min: Lower bound of the adaptive lambda.
        lambda_max: Upper bound of the adaptive lambda.
        ratio_low: Below this gradient share ``lambda * |grad L_pref| / M`` lambda grows.
        ratio_high: Above this share lambda shrinks.
        lambda_up: Growth factor.
        lambda_down: Shrink factor.
        scale_ema: Decay of the moving average ``M`` of the policy-gradient magnitude.
    """

    def __init__(
        self,
        aggregation: Aggregation = "grpo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        importance_sampling: ImportanceSampling = "token",
        beta: float = 0.0,
        mask_truncated_completions: bool = False,
        max_completion_length: int | None = None,
        sampling_correction: SamplingCorrection = "token_truncate",
        sampling_cap: float = 3.0,
        lambda_: float = 0.01,
        pair_beta: float = 0.2,
        margin: float = 0.0,
        pair_mode: PairMode = "all",
        max_pairs_per_group: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
        reference_free: bool = True,
        lambda_schedule: LambdaSchedule = "adaptive",
        lambda_min: float = 0.005,
        lambda_max: float = 0.05,
        ratio_low: float = 0.005,
        ratio_high: float = 0.015,
        lambda_up: float = 1.25,
        lambda_down: float = 0.8,
        scale_ema: float = 0.9,
    ) -> None:
        super().__init__(
            aggregation=aggregation,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            importance_sampling=importance_sampling,
            beta=beta,
            mask_truncated_completions=mask_truncated_completions,
            max_completion_length=max_completion_length,
            sampling_correction=sampling_correction,
            sampling_cap=sampling_cap,
        )
        errors: list[str] = []
        check_number(errors, f"{_KEY}.lambda_", lambda_, ge=0)
        check_number(errors, f"{_KEY}.pair_beta", pair_beta, gt=0)
        check_number(errors, f"{_KEY}.margin", margin, ge=0)  # pairs are strictly ordered by reward
        for name, value in (("lambda_min", lambda_min), ("lambda_max", lambda_max), ("lambda_up", lambda_up)):
            check_number(errors, f"{_KEY}.{name}", value, gt=0)
        for name, value in (("ratio_low", ratio_low), ("ratio_high", ratio_high), ("lambda_down", lambda_down)):
            check_number(errors, f"{_KEY}.{name}", value, ge=0)
        if pair_mode not in ("all", "top1"):
            errors.append(f"{_KEY}.pair_mode must be 'all' or 'top1', got {pair_mode!r}")
        if max_pairs_per_group is not None and max_pairs_per_group < 1:
            errors.append(f"{_KEY}.max_pairs_per_group must be >= 1 or null, got {max_pairs_per_group}")
        if reduction not in ("mean", "sum"):
            errors.append(f"{_KEY}.reduction must be 'mean' or 'sum', got {reduction!r}")
        if lambda_schedule not in ("fixed", "adaptive"):
            errors.append(f"{_KEY}.lambda_schedule must be 'fixed' or 'adaptive', got {lambda_schedule!r}")
        if not 0 < lambda_min <= lambda_max:
            errors.append(f"{_KEY}: need 0 < lambda_min <= lambda_max, got {lambda_min} and {lambda_max}")
        if not 0 <= ratio_low < ratio_high:
            errors.append(f"{_KEY}: need 0 <= ratio_low < ratio_high, got {ratio_low} and {ratio_high}")
        if not (lambda_up > 1 and 0 < lambda_down < 1):
            errors.append(f"{_KEY}: need lambda_up > 1 and 0 < lambda_down < 1, got {lambda_up} and {lambda_down}")
        if not 0 <= scale_ema < 1:
            errors.append(f"{_KEY}.scale_ema must be in [0, 1), got {scale_ema}")
        raise_errors(errors)
        self.pair_beta = pair_beta
        self.margin = margin
        self.pair_mode = pair_mode
        self.max_pairs_per_group = max_pairs_per_group
        self.reduction = reduction
        self.reference_free = reference_free
        self.lambda_schedule = lambda_schedule
        self.lambda_min, self.lambda_max = lambda_min, lambda_max
        self.ratio_low, self.ratio_high = ratio_low, ratio_high
        self.lambda_up, self.lambda_down = lambda_up, lambda_down
        self.scale_ema = scale_ema
        # Buffers, so the controller state is saved in and restored from checkpoints with the module.
        self.register_buffer("lambda_value", torch.tensor(float(lambda_), dtype=torch.float64))
        self.register_buffer("pg_scale_ema", torch.tensor(-1.0, dtype=torch.float64))  # < 0: not yet seen

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed (KL term, or the pair term with a reference)."""
        return self.beta != 0.0 or not self.reference_free

    def pairs(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Mine this loss's pairs from ``rewards`` ``[N]``: ``LongTensor[P, 2]``."""
        return mine_pairs(rewards, group_size, self.margin, self.pair_mode, self.max_pairs_per_group)

    def step_normalizers(
        self,
        completion_lengths: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        truncated: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """GRPO's normalisers plus ``num_pairs``, the pairs mined over the whole step."""
        norms = super().step_normalizers(completion_lengths, rewards, group_size, truncated)
        norms["num_pairs"] = float(self.pairs(rewards, group_size).shape[0])
        return norms

    def forward(
        self,
        token_logps: torch.Tensor,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        old_token_logps: torch.Tensor | None = None,
        ref_token_logps: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        num_sequences: float | None = None,
        num_tokens: float | None = None,
        max_length: float | None = None,
        sampling_token_logps: torch.Tensor | None = None,
        num_pairs: float | None = None,
    ) -> LossOutput:
        """GRPO loss plus ``lambda *`` the pooled pair loss; arguments as ``GRPOLoss.forward`` plus ``num_pairs``.

        ``num_pairs`` is the number of pairs in the whole step (default: those of this call).
        """
        lam = float(self.lambda_value)
        with torch.no_grad():
            pair_loss, row_grad, pair_stats = self._pair_term(
                token_logps.detach(), completion_mask, rewards, group_size, ref_token_logps, num_pairs
            )
        out = self.policy_terms(
            token_logps,
            completion_mask,
            advantages,
            old_token_logps=old_token_logps,
            ref_token_logps=ref_token_logps,
            truncated=truncated,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            max_length=max_length,
            sampling_token_logps=sampling_token_logps,
            extra_value=lam * pair_loss,
            extra_row_grad=lam * row_grad if lam != 0.0 else None,
        )
        out.stats.update(pair_stats)
        out.stats["pair_term"] = lam * pair_loss
        out.stats["lambda"] = torch.tensor(lam)
        return out

    def _pair_term(
        self,
        logps: torch.Tensor,
        completion_mask: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        ref_token_logps: torch.Tensor | None,
        num_pairs: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Pooled pair loss, its gradient per row (times ``completion_mask`` gives d/d logp), and stats.

        Dense over ``[B, G, G]``: with ``z_ij = beta * (x_i - x_j)`` (x = l - l_ref),
        d L / d l_i = (beta / P) * (sum_j -sigmoid(-z_ij) [pair ij] + sum_j sigmoid(-z_ji) [pair ji]).
        """
        mask = completion_mask.to(logps.dtype)  # [N, T]
        lengths = mask.sum(-1).clamp(min=1.0) if self.reduction == "mean" else torch.ones_like(mask[:, 0])  # [N]
        seq = torch.linalg.vecdot(logps, mask).div_(lengths)  # [N] sequence log-probs l
        x = seq
        if not self.reference_free:
            if ref_token_logps is None:
                raise ValueError("AmirGRPOLoss with reference_free=False needs ref_token_logps (a reference model)")
            x = seq - torch.linalg.vecdot(ref_token_logps.to(logps.dtype), mask).div_(lengths)  # [N]
        valid, gaps = pair_mask_and_gaps(rewards, group_size, self.margin, self.pair_mode, self.max_pairs_per_group)
        on = valid.to(logps.dtype)  # [B, G, G]
        count = on.sum()
        denom = max(float(count) if num_pairs is None else float(num_pairs), 1.0)
        xg = x.view(-1, group_size)  # [B, G]
        neg_z = (xg.unsqueeze(1) - xg.unsqueeze(2)).mul_(self.pair_beta)  # [B, G, G] -z_ij
        pair_loss = torch.linalg.vecdot(F.softplus(neg_z).view(-1), on.view(-1)) / denom  # -log sigmoid(z)
        weight = torch.sigmoid(neg_z).mul_(on).mul_(self.pair_beta / denom)  # [B, G, G] -dL/dz_ij
        row_grad = (weight.sum(1) - weight.sum(2)).view(-1).div_(lengths)  # [N]
        sg = seq.view(-1, group_size)  # [B, G]
        margins = (sg.unsqueeze(2) - sg.unsqueeze(1)).mul_(on)  # [B, G, G] policy margins of the pairs
        stats = {
            "pair_loss": pair_loss,
            "num_pairs": count,
            "pair_acc": (neg_z < 0).logical_and_(valid).sum().to(logps.dtype) / denom,
            "pair_margin": margins.sum() / denom,
            "pair_reward_gap": gaps.to(logps.dtype).nan_to_num_().mul_(on).sum() / denom,
            # Gradient mass of L_pref on the log-probs, sum_it |dL_pref / d logp_it|: the pair term's pull, to set
            # against the policy gradient's (pg_scale) at the same scale.
            "pair_grad": (row_grad.abs() * mask.sum(-1)).sum(),
        }
        return pair_loss, row_grad, stats

    @torch.no_grad()
    def end_step(self, step_stats: dict[str, torch.Tensor]) -> None:
        """Update lambda from the step's pooled ``pair_grad`` and ``pg_scale`` (steps without pairs are skipped)."""
        if self.lambda_schedule == "fixed" or float(step_stats.get("num_pairs", 0.0)) == 0.0:
            return
        scale = float(step_stats["pg_scale"])
        ema = float(self.pg_scale_ema)
        ema = scale if ema < 0 else self.scale_ema * ema + (1.0 - self.scale_ema) * scale
        self.pg_scale_ema.fill_(ema)
        lam = float(self.lambda_value)
        ratio = lam * float(step_stats["pair_grad"]) / max(ema, 1e-8)
        if ratio < self.ratio_low:
            lam *= self.lambda_up
        elif ratio > self.ratio_high:
            lam *= self.lambda_down
        self.lambda_value.fill_(min(max(lam, self.lambda_min), self.lambda_max))
