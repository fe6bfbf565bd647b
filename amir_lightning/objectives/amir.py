"""AMIR-GRPO: GRPO plus an implicit preference term mined from each group's reward ranking (arXiv 2601.03661).

    loss = L_GRPO + lambda * L_pref
    L_pref = -(1 / P_step) sum_{(i, j) in S} log sigmoid(beta_pair * [(l_i - lref_i) - (l_j - lref_j)])
    S = {(i, j) same group : r_i - r_j > margin}

``l`` comes from the token log-probs of the GRPO forward pass: no second forward, ever. The objective is a
composition: the GRPO term (``GRPOLoss``), the pair term (``preference.preference_loss``) and the lambda schedule
(``LambdaSchedule``), each small; autograd takes the gradient.

The adaptive lambda schedule keeps the pair term's pull at a set share of the policy gradient's: once per step,
with ``rho = lambda * |grad L_pref| / M``, lambda is multiplied by ``grow`` when ``rho < share_low`` and by
``shrink`` when ``rho > share_high``, then clamped to ``[min, max]`` (the settings of ``pair_weight``).
``|grad L_pref|`` is the gradient mass of the pair loss on the token log-probs (``sum_it |dL_pref / d logp_it|``,
the ``pair_grad`` stat) and ``M`` an exponential moving average of the policy gradient's (``pg_scale``,
``agg(|min(rho A, clip A)|)``).

Deliberate deviations from the official controller (AmirHosseinYari2002/AMIR-GRPO, Train/trainer.py), which
compares ``lambda * L_pref`` with the signed GRPO loss, band 0.30-0.70, x1.25 / x0.8, bounds 0.005-0.05:
- The official band cannot be met inside the official bounds. On-policy the signed GRPO loss is ``-mean(A) + beta
  KL``, about zero with a random sign, so its ratio explodes or flips and lambda random-walks. Against the
  policy-gradient magnitude instead, ``L_pref`` stays near log 2 (``pair_term.beta`` 0.2 keeps ``z`` small) and the
  band needs lambda 0.35-0.9; measured in ``make demo``, lambda sat at its maximum for all 12 steps.
- So the statistic is the gradient share ``rho`` and the default band 0.005-0.015: the pair term pulls 0.5-1.5 %
  as hard as the policy gradient, which is where the official lambda range puts it. Measured in ``make demo``
  (tests/fixtures/demo_lambda_stats.json): ``|grad L_pref|`` stays at 0.18-0.19 (a mean over pairs) while ``M``
  falls from 0.8 to 0.08 as groups lose reward variance, so the pair term's share grows tenfold unless lambda
  follows. Replayed on those statistics, lambda goes 0.05 -> 0.04 -> 0.032 from the demo's start and 0.01 ->
  0.0195 from qwen.yaml's, off its bounds at every step (tests/test_lambda_schedule.py).
- lambda is updated once per optimisation step, after it, from the step's pooled values, and used from the next
  step: the gradient of a step then does not depend on how it was split into micro-batches (the official code
  compares the full pair loss with one micro-batch's GRPO loss).
- The clamp to ``[min, max]`` applies on every update, so an initial lambda outside the bounds is pulled in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn
from typing_extensions import override

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.objectives.base import LossOutput, StepContext
from amir_lightning.objectives.grpo import GRPOLoss
from amir_lightning.objectives.logprobs import sequence_logps
from amir_lightning.objectives.pairs import PairMode, PairRule
from amir_lightning.objectives.preference import pair_logits, preference_loss

#: Where these arguments live in a YAML config, for error messages.
_KEY = "model.loss.init_args"
Schedule = Literal["fixed", "adaptive"]


@dataclass
class PairTermSettings:
    """Which pairs the term trains on and how it scores them (``model.loss.init_args.pair_term``).

    Attributes:
        beta: Inverse temperature of the pair logistic (``beta_dpo`` of arXiv 2601.03661, Eq. 6).
        margin: Reward gap a pair needs, strictly: ``r_chosen - r_rejected > margin``.
        mode: ``all`` pairs or ``top1`` (the best of each group against the rest).
        max_per_group: Keep at most this many pairs per group, the largest reward gaps first (``None``: all).
        reduction: Sequence log-prob of a completion: ``mean`` over its tokens (length-normalised, the official
            runs) or ``sum`` (the first official commit).
        reference_free: ``l_ref = 0`` (every official run); ``False`` subtracts the reference policy's log-probs
            and needs a reference model.
    """

    beta: float = 0.2
    margin: float = 0.0
    mode: PairMode = "all"
    max_per_group: int | None = None
    reduction: Literal["mean", "sum"] = "mean"
    reference_free: bool = True

    def __post_init__(self) -> None:
        key, errors = f"{_KEY}.pair_term", []
        check_number(errors, f"{key}.beta", self.beta, gt=0)
        check_number(errors, f"{key}.margin", self.margin, ge=0)  # pairs are strictly ordered by reward
        check_number(errors, f"{key}.max_per_group", self.max_per_group, ge=1, optional=True)
        if self.mode not in ("all", "top1"):
            errors.append(f"{key}.mode must be 'all' or 'top1', got {self.mode!r}")
        if self.reduction not in ("mean", "sum"):
            errors.append(f"{key}.reduction must be 'mean' or 'sum', got {self.reduction!r}")
        raise_errors(errors)


@dataclass
class PairWeightSettings:
    """The pair term's weight lambda: fixed, or adapted to its share of the gradient (``...init_args.pair_weight``).

    Attributes:
        value: The starting lambda (``adaptive``), or lambda itself (``fixed``).
        schedule: ``fixed`` or ``adaptive`` (the module docstring: the band on the pair term's gradient share).
        min: Lower bound of the adaptive lambda.
        max: Upper bound of the adaptive lambda.
        share_low: Below this gradient share ``lambda * |grad L_pref| / M`` lambda grows.
        share_high: Above this share lambda shrinks.
        grow: Growth factor (> 1).
        shrink: Shrink factor (in (0, 1)).
        scale_ema: Decay of the moving average ``M`` of the policy-gradient magnitude.
    """

    value: float = 0.01
    schedule: Schedule = "adaptive"
    min: float = 0.005
    max: float = 0.05
    share_low: float = 0.005
    share_high: float = 0.015
    grow: float = 1.25
    shrink: float = 0.8
    scale_ema: float = 0.9

    def __post_init__(self) -> None:
        key, errors = f"{_KEY}.pair_weight", []
        check_number(errors, f"{key}.value", self.value, ge=0)
        for name in ("min", "max", "grow"):
            check_number(errors, f"{key}.{name}", getattr(self, name), gt=0)
        for name in ("share_low", "share_high", "shrink"):
            check_number(errors, f"{key}.{name}", getattr(self, name), ge=0)
        if self.schedule not in ("fixed", "adaptive"):
            errors.append(f"{key}.schedule must be 'fixed' or 'adaptive', got {self.schedule!r}")
        if not errors and not 0 < self.min <= self.max:
            errors.append(f"{key}: need 0 < min <= max, got {self.min} and {self.max}")
        if not errors and not 0 <= self.share_low < self.share_high:
            errors.append(f"{key}: need 0 <= share_low < share_high, got {self.share_low} and {self.share_high}")
        if not errors and not (self.grow > 1 and 0 < self.shrink < 1):
            errors.append(f"{key}: need grow > 1 and 0 < shrink < 1, got {self.grow} and {self.shrink}")
        check_number(errors, f"{key}.scale_ema", self.scale_ema, ge=0)
        if not errors and not self.scale_ema < 1:
            errors.append(f"{key}.scale_ema must be in [0, 1), got {self.scale_ema}")
        raise_errors(errors)


class LambdaSchedule(nn.Module):
    """The weight lambda of the pair term: fixed, or the adaptive band on its gradient share (module docstring).

    Its state is two buffers, saved in and restored from checkpoints with the module. An adaptive lambda resumes
    where the controller left it (``value`` is only its starting value); a fixed one is this run's ``value``.

    Args:
        settings: The schedule and its bounds (``PairWeightSettings``).
    """

    def __init__(self, settings: PairWeightSettings) -> None:
        super().__init__()
        self.settings = settings
        self.register_buffer("lambda_value", torch.tensor(float(settings.value), dtype=torch.float64))
        self.register_buffer("pg_scale_ema", torch.tensor(-1.0, dtype=torch.float64))  # < 0: not yet seen

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A fixed lambda is configuration, not state: on resume this run's value wins over the checkpoint's."""
        given = float(self.lambda_value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.settings.schedule == "fixed":
            self.lambda_value.fill_(given)

    @torch.no_grad()
    def update(self, pair_grad: float, pg_scale: float) -> None:
        """One step's update from its pooled pair-gradient mass and policy-gradient magnitude."""
        if self.settings.schedule == "fixed":
            return
        s = self.settings
        ema = float(self.pg_scale_ema)
        ema = pg_scale if ema < 0 else s.scale_ema * ema + (1.0 - s.scale_ema) * pg_scale
        self.pg_scale_ema.fill_(ema)
        lam = float(self.lambda_value)
        share = lam * pair_grad / max(ema, 1e-8)
        if share < s.share_low:
            lam *= s.grow
        elif share > s.share_high:
            lam *= s.shrink
        self.lambda_value.fill_(min(max(lam, s.min), s.max))


class AmirGRPOLoss(GRPOLoss):
    """GRPO loss plus the AMIR pairwise preference term; every ``GRPOLoss`` argument is accepted as well.

    Args:
        pair_term: Which pairs the term trains on and how it scores them (``beta``, ``margin``, ``mode``,
            ``max_per_group``, ``reduction``, ``reference_free``).
        pair_weight: The term's weight lambda: ``value``, ``schedule`` (``fixed`` or ``adaptive``) and the adaptive
            band and bounds.
        **grpo: ``GRPOLoss``'s arguments (the policy term). ``mask_truncated_completions`` drops truncated
            completions from the GRPO term only (a truncated low-reward completion is a legitimate rejected sample),
            and the ``sampling_correction`` weights do not touch the pair term.
    """

    def __init__(
        self,
        pair_term: PairTermSettings = PairTermSettings(),  # noqa: B008 (settings are never mutated)
        pair_weight: PairWeightSettings = PairWeightSettings(),  # noqa: B008
        **grpo,
    ) -> None:
        super().__init__(**grpo)
        self.pair_term = pair_term
        self.pair_rule = PairRule(pair_term.margin, pair_term.mode, pair_term.max_per_group)
        self.schedule = LambdaSchedule(pair_weight)

    @override
    def added_reference_uses(self) -> list[str]:
        return [] if self.pair_term.reference_free else ["pair_term.reference_free=False"]

    @property
    def lambda_now(self) -> float:  # noqa: D102
        return float(self.schedule.lambda_value)

    @override
    def regularize(
        self, out: LossOutput, logps: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor | None, context: StepContext
    ) -> LossOutput:
        """The GRPO term's output plus ``lambda *`` the pair loss of its pairs, pooled over the step's pairs."""
        pair_loss, stats, push = self.pair_loss(logps, mask, out.rows.pairs, ref, context)
        loss = out.loss + context.lambda_ * pair_loss
        added = stats | {"amir/pair_term": context.lambda_ * pair_loss.detach(), "train/loss": loss.detach()}
        rows = replace(out.rows, pair_push=context.lambda_ * push)
        return LossOutput(loss, out.stats | added, rows)

    def pair_loss(
        self,
        logps: torch.Tensor,
        completion_mask: torch.Tensor,
        pairs: torch.Tensor,
        ref_logps: torch.Tensor | None,
        context: StepContext,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The pooled pair loss of this micro-batch's pairs, its stats, and each row's per-token push-down.

        With ``w_p = beta * sigmoid(-z_p) / P_step`` the pair loss's gradient on ``l`` of a pair's rejected
        completion: the push-down a row gets is the sum of ``w_p`` over the pairs it loses, per token of it.
        """
        beta, reduction = self.pair_term.beta, self.pair_term.reduction
        seq = sequence_logps(logps, completion_mask, reduction)  # [N] l
        ref = None
        if not self.pair_term.reference_free:
            ref = sequence_logps(ref_logps.to(logps.dtype), completion_mask, reduction).detach()
        pair_loss = preference_loss(seq, pairs, beta, ref, context.num_pairs)
        with torch.no_grad():
            z, _ = pair_logits(seq.detach(), pairs, beta, ref)  # [P]
            weight = torch.sigmoid(-z) * beta / max(context.num_pairs, 1.0)  # [P] |dL / dz| * beta
            per_token = completion_mask.sum(-1).clamp(min=1.0) if reduction == "mean" else seq.new_ones(())
            push = seq.new_zeros(seq.shape).index_add_(0, pairs[:, 1], weight) / per_token  # [N]
            grad_l = push * per_token - seq.new_zeros(seq.shape).index_add_(0, pairs[:, 0], weight)  # dL/dl
            lengths = completion_mask.sum(-1).to(seq.dtype)
            stats = {
                "amir/pair_loss": pair_loss.detach(),
                "amir/implicit_acc": (z > 0).sum().to(seq.dtype) / max(context.num_pairs, 1.0),
                # Gradient mass of L_pref on the token log-probs, sum_it |dL_pref / d logp_it|: the pair term's pull,
                # to set against the policy gradient's (pg_scale) at the same scale.
                "amir/pair_grad": (grad_l.abs() * lengths / per_token).sum(),
            }
        return pair_loss, stats, push

    def end_step(self, step_stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """Update lambda from the step's pooled ``amir/pair_grad`` and ``train/pg_scale`` (not without pairs).

        Returns:
            ``amir/lambda``: the lambda this step trained with (the next step's is set now).
        """
        trained_with = self.lambda_now
        if float(step_stats.get("amir/num_pairs", 0.0)) > 0.0:
            self.schedule.update(float(step_stats["amir/pair_grad"]), float(step_stats["train/pg_scale"]))
        return {"amir/lambda": trained_with}
