"""AMIR-GRPO: GRPO plus an implicit preference term mined from each group's reward ranking (arXiv 2601.03661).

    loss = L_GRPO + lambda * L_pref
    L_pref = -(1 / P_step) sum_{(i, j) in S} log sigmoid(beta_pair * [(l_i - lref_i) - (l_j - lref_j)])
    S = {(i, j) same group : r_i - r_j > margin}

``l`` comes from the token log-probs of the GRPO forward pass: no second forward, ever. The objective is a
composition: the GRPO term (``GRPOLoss``), the pair term (``preference.preference_loss``) and the lambda schedule
(``LambdaSchedule``), each small; autograd takes the gradient.

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
from torch import nn

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.objectives.base import LossOutput, StepContext
from amir_lightning.objectives.logprobs import sequence_logps
from amir_lightning.objectives.pairs import PairMode, mine_pairs
from amir_lightning.objectives.policy import GRPOLoss
from amir_lightning.objectives.preference import pair_logits, preference_loss

#: Where these arguments live in a YAML config, for error messages.
_KEY = "model.loss.init_args"
Schedule = Literal["fixed", "adaptive"]


class LambdaSchedule(nn.Module):
    """The weight lambda of the pair term: fixed, or the adaptive band on its gradient share (module docstring).

    Its state is two buffers, saved in and restored from checkpoints with the module. An adaptive lambda resumes
    where the controller left it (``lambda_`` is only its starting value); a fixed one is this run's ``lambda_``.
    """

    def __init__(
        self,
        lambda_: float,
        schedule: Schedule,
        lambda_min: float,
        lambda_max: float,
        ratio_low: float,
        ratio_high: float,
        lambda_up: float,
        lambda_down: float,
        scale_ema: float,
    ) -> None:
        super().__init__()
        self.schedule = schedule
        self.lambda_min, self.lambda_max = lambda_min, lambda_max
        self.ratio_low, self.ratio_high = ratio_low, ratio_high
        self.lambda_up, self.lambda_down = lambda_up, lambda_down
        self.scale_ema = scale_ema
        self.register_buffer("lambda_value", torch.tensor(float(lambda_), dtype=torch.float64))
        self.register_buffer("pg_scale_ema", torch.tensor(-1.0, dtype=torch.float64))  # < 0: not yet seen

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A fixed lambda is configuration, not state: on resume this run's value wins over the checkpoint's."""
        given = float(self.lambda_value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.schedule == "fixed":
            self.lambda_value.fill_(given)

    @torch.no_grad()
    def update(self, pair_grad: float, pg_scale: float) -> None:
        """One step's update from its pooled pair-gradient mass and policy-gradient magnitude."""
        if self.schedule == "fixed":
            return
        ema = float(self.pg_scale_ema)
        ema = pg_scale if ema < 0 else self.scale_ema * ema + (1.0 - self.scale_ema) * pg_scale
        self.pg_scale_ema.fill_(ema)
        lam = float(self.lambda_value)
        ratio = lam * pair_grad / max(ema, 1e-8)
        if ratio < self.ratio_low:
            lam *= self.lambda_up
        elif ratio > self.ratio_high:
            lam *= self.lambda_down
        self.lambda_value.fill_(min(max(lam, self.lambda_min), self.lambda_max))


class AmirGRPOLoss(GRPOLoss):
    """GRPO loss plus the AMIR pairwise preference term; every ``GRPOLoss`` argument is accepted as well.

    Args:
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
        **grpo: ``GRPOLoss``'s arguments. ``mask_truncated_completions`` drops truncated completions from the GRPO
            term only (a truncated low-reward completion is a legitimate rejected sample), and the
            ``sampling_correction`` weights do not touch the pair term.
    """

    def __init__(
        self,
        lambda_: float = 0.01,
        pair_beta: float = 0.2,
        margin: float = 0.0,
        pair_mode: PairMode = "all",
        max_pairs_per_group: int | None = None,
        reduction: Literal["mean", "sum"] = "mean",
        reference_free: bool = True,
        lambda_schedule: Schedule = "adaptive",
        lambda_min: float = 0.005,
        lambda_max: float = 0.05,
        ratio_low: float = 0.005,
        ratio_high: float = 0.015,
        lambda_up: float = 1.25,
        lambda_down: float = 0.8,
        scale_ema: float = 0.9,
        **grpo,
    ) -> None:
        super().__init__(**grpo)
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
        self.pair_beta, self.margin, self.pair_mode = pair_beta, margin, pair_mode
        self.max_pairs_per_group, self.reduction, self.reference_free = max_pairs_per_group, reduction, reference_free
        self.schedule = LambdaSchedule(
            lambda_, lambda_schedule, lambda_min, lambda_max, ratio_low, ratio_high, lambda_up, lambda_down, scale_ema
        )

    def reference_uses(self) -> list[str]:  # noqa: D102
        return super().reference_uses() + ([] if self.reference_free else ["reference_free=False"])

    @property
    def lambda_now(self) -> float:  # noqa: D102
        return float(self.schedule.lambda_value)

    def pairs(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """This loss's pairs of ``rewards`` ``[N]``: ``LongTensor[P, 2]`` of (chosen, rejected) rows."""
        return mine_pairs(rewards, group_size, self.margin, self.pair_mode, self.max_pairs_per_group)

    def add_pair_term(
        self, out: LossOutput, token_logps: torch.Tensor, completion_mask: torch.Tensor, ref_token_logps, context
    ) -> LossOutput:
        """``lambda *`` the pair loss pooled over the step's pairs, added to the GRPO term's output."""
        pair_loss, stats, push = self.pair_term(token_logps, completion_mask, out.rows.pairs, ref_token_logps, context)
        out.loss = out.loss + context.lambda_ * pair_loss
        out.stats.update(stats)
        out.stats["amir/pair_term"] = context.lambda_ * pair_loss.detach()
        out.stats["train/loss"] = out.loss.detach()
        out.rows.pair_push = context.lambda_ * push
        return out

    def pair_term(
        self,
        token_logps: torch.Tensor,
        completion_mask: torch.Tensor,
        pairs: torch.Tensor,
        ref_token_logps: torch.Tensor | None,
        context: StepContext,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The pooled pair loss of this micro-batch's pairs, its stats, and each row's per-token push-down.

        With ``w_p = beta * sigmoid(-z_p) / P_step`` the pair loss's gradient on ``l`` of a pair's rejected
        completion: the push-down a row gets is the sum of ``w_p`` over the pairs it loses, per token of it.
        """
        seq = sequence_logps(token_logps, completion_mask, self.reduction)  # [N] l
        ref = None
        if not self.reference_free:
            ref = sequence_logps(ref_token_logps.to(token_logps.dtype), completion_mask, self.reduction).detach()
        pair_loss = preference_loss(seq, pairs, self.pair_beta, ref, context.num_pairs)
        with torch.no_grad():
            z, _ = pair_logits(seq.detach(), pairs, self.pair_beta, ref)  # [P]
            weight = torch.sigmoid(-z) * self.pair_beta / max(context.num_pairs, 1.0)  # [P] |dL / dz| * beta
            per_token = completion_mask.sum(-1).clamp(min=1.0) if self.reduction == "mean" else seq.new_ones(())
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

    def end_step(self, step_stats: dict[str, torch.Tensor]) -> None:
        """Update lambda from the step's pooled ``amir/pair_grad`` and ``train/pg_scale`` (not without pairs)."""
        if float(step_stats.get("amir/num_pairs", 0.0)) > 0.0:
            self.schedule.update(float(step_stats["amir/pair_grad"]), float(step_stats["train/pg_scale"]))
