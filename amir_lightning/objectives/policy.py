"""GRPO's clipped policy-gradient objective with TRL GRPOTrainer's aggregation modes (arXiv 2402.03300).

    rho_i,t = exp(logp_i,t - old_i,t)                (token)   or  exp(mean_t(logp_i - old_i))  (sequence, GSPO)
    c_i,t   = -min(rho A_i, clip(rho, 1 - eps, 1 + eps_high) A_i) + beta * k3_i,t
    k3      = exp(ref - logp) - (ref - logp) - 1

Aggregation of the per-token loss ``c`` over one optimisation step of N completions:
    grpo     (1/N) sum_i (1/|o_i|) sum_t c_i,t              mean over sequences of the per-sequence token mean
    bnpo     sum_i,t c_i,t / sum_i |o_i|                    token mean over this process's step batch, then the
                                                            mean over processes
    dapo     sum_i,t c_i,t / sum_i |o_i|                    token mean over the global step batch (all processes)
    dr_grpo  sum_i,t c_i,t / (N * L)                        L = max_completion_length (or the step's longest)

Micro-batches hold whole groups and receive the step's normalisers (``num_sequences``, ``num_tokens``,
``max_length``) as keyword arguments, so summing their losses gives exactly the full-batch loss and gradient.

Engine/trainer mismatch (TRL's ``vllm_importance_sampling_correction``): the rollout engine samples with its own
kernels and dtype, so its distribution q differs slightly from the trainer's p_old. Given the engine's log-probs
of the sampled tokens, each token's loss is weighted by w = p_old / q, truncated at ``sampling_cap`` (``*_truncate``)
or zeroed above it (``*_mask``), per token or with one ratio per sequence (the product of its token ratios).
p_old is ``old_token_logps`` off-policy and the forward's own detached log-probs on-policy (no extra forward).
The k3 estimate of KL(q || p_old) per token is logged whether or not the correction is on. The AMIR pair term is
not reweighted: it is a sequence-level regulariser, not an expectation under the sampling policy.

Deliberate deviations from TRL:
- ``bnpo`` normalises by the tokens of the process's whole step batch, not of each micro-batch: TRL's choice makes
  the gradient depend on the micro-batch size. On one process ``bnpo`` and ``dapo`` therefore coincide.
- Every stat is additive over the micro-batches of a step (its value is the micro-batch's share), so a step's
  stats are their sum; clip fractions are token fractions of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from amir_lightning.objectives.aggregation import global_normalizers, row_weights, step_normalizers
from amir_lightning.objectives.base import LossOutput, WithGrad
from amir_lightning.objectives.mismatch import mismatch_weights
from amir_lightning.validation import check_number, raise_errors

#: Where these arguments live in a YAML config, for error messages.
_KEY = "model.loss.init_args"
Aggregation = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSampling = Literal["token", "sequence"]
SamplingCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]


class GRPOLoss(nn.Module):
    """Clipped-surrogate GRPO loss over per-token log-probs.

    Args:
        aggregation: How token losses are reduced: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (module docstring).
        epsilon: Lower clip range, ``rho >= 1 - epsilon``.
        epsilon_high: Upper clip range ``rho <= 1 + epsilon_high`` (DAPO's clip-higher); defaults to ``epsilon``.
        importance_sampling: ``token`` ratios (GRPO) or one ``sequence`` ratio per completion (GSPO). On-policy
            (``old_token_logps=None``) both give the same gradient.
        beta: Coefficient of the k3 KL penalty to the reference policy; 0 needs no reference model.
        mask_truncated_completions: Drop completions that hit the length limit from the policy-gradient term.
        max_completion_length: ``L`` of ``dr_grpo``; ``None`` uses the longest completion of the step.
        sampling_correction: Importance weights for the engine/trainer mismatch (module docstring), or ``none``.
        sampling_cap: Largest importance weight kept (TRL's ``vllm_importance_sampling_clip_max``).
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
    ) -> None:
        super().__init__()
        errors = []
        if aggregation not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            errors.append(f"{_KEY}.aggregation must be one of grpo, bnpo, dr_grpo, dapo, got {aggregation!r}")
        if importance_sampling not in ("token", "sequence"):
            errors.append(f"{_KEY}.importance_sampling must be 'token' or 'sequence', got {importance_sampling!r}")
        if not 0 <= epsilon < 1:
            errors.append(f"{_KEY}.epsilon must be in [0, 1), got {epsilon}")
        check_number(errors, f"{_KEY}.epsilon_high", epsilon_high, ge=0, optional=True)
        check_number(errors, f"{_KEY}.beta (KL coefficient)", beta, ge=0)
        check_number(errors, f"{_KEY}.max_completion_length", max_completion_length, ge=1, optional=True)
        corrections = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
        if sampling_correction not in corrections:
            errors.append(
                f"{_KEY}.sampling_correction must be one of {', '.join(corrections)}, got {sampling_correction!r}"
            )
        check_number(errors, f"{_KEY}.sampling_cap", sampling_cap, ge=1)
        raise_errors(errors)
        self.sampling_correction, self.sampling_cap = sampling_correction, sampling_cap
        self.aggregation = aggregation
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.importance_sampling = importance_sampling
        self.beta = beta
        self.mask_truncated_completions = mask_truncated_completions
        self.max_completion_length = max_completion_length

    @property
    def needs_reference(self) -> bool:
        """Whether ``ref_token_logps`` must be passed (a frozen reference model is needed)."""
        return self.beta != 0.0

    def step_normalizers(
        self,
        completion_lengths: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        truncated: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Normalisers of a whole optimisation step, passed to every micro-batch's call.

        Args:
            completion_lengths: ``[N]`` completion token counts of every completion of the step.
            rewards: ``[N]`` rewards of the step (used by subclasses that mine pairs).
            group_size: ``G``.
            truncated: ``[N]`` bool, completions that hit the length limit.

        Returns:
            ``num_sequences``, ``num_tokens`` (tokens that enter the policy-gradient term) and ``max_length``.
        """
        return step_normalizers(
            completion_lengths, truncated, self.mask_truncated_completions, self.max_completion_length
        )

    def global_normalizers(
        self, local: dict[str, float], world_size: int, all_reduce: Callable[[torch.Tensor, str], torch.Tensor]
    ) -> dict[str, float]:
        """Normalisers of the step across processes (``aggregation.global_normalizers``)."""
        return global_normalizers(local, world_size, all_reduce, self.aggregation)

    def _row_weights(self, lengths: torch.Tensor, norms: dict[str, float]) -> torch.Tensor:
        """``[N]`` weight of each token of row i in the step loss (``aggregation.row_weights``)."""
        return row_weights(self.aggregation, lengths, norms)

    def policy_terms(
        self,
        token_logps: torch.Tensor,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        old_token_logps: torch.Tensor | None = None,
        ref_token_logps: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        num_sequences: float | None = None,
        num_tokens: float | None = None,
        max_length: float | None = None,
        sampling_token_logps: torch.Tensor | None = None,
        extra_value: torch.Tensor | None = None,
        extra_row_grad: torch.Tensor | None = None,
    ) -> LossOutput:
        """The GRPO term, plus optionally a subclass's term given by its value and gradient.

        The extra term (``extra_value``, a scalar) must have gradient ``extra_row_grad[i] * completion_mask[i, t]``
        with respect to ``token_logps`` (true of any function of summed or length-normalised sequence log-probs).
        It is folded into the same closed-form backward, so it costs no autograd node.
        """
        mask = completion_mask.to(token_logps.dtype)  # [N, T]
        folded_extra = extra_row_grad  # the extra term shares the policy-gradient mask: fold it into one pass
        if self.mask_truncated_completions and truncated is not None:
            mask = mask * (~truncated.bool()).to(mask.dtype).unsqueeze(1)  # [N, T]
            folded_extra = None
        if self.beta != 0.0 and ref_token_logps is None:
            raise ValueError("GRPOLoss with beta != 0 needs ref_token_logps (a reference model)")
        with torch.no_grad():
            lengths = mask.sum(-1)  # [N]
            norms = {
                "num_sequences": float(token_logps.shape[0]) if num_sequences is None else float(num_sequences),
                "num_tokens": float(lengths.sum()) if num_tokens is None else float(num_tokens),
                "max_length": float(self.max_completion_length or token_logps.shape[1])
                if max_length is None
                else float(max_length),
            }
            weights, mismatch_stats = None, {}
            if sampling_token_logps is not None:
                behaviour = token_logps if old_token_logps is None else old_token_logps  # [N, T] p_old
                weights, mismatch_stats = mismatch_weights(
                    behaviour,
                    sampling_token_logps,
                    mask,
                    self.sampling_correction,
                    self.sampling_cap,
                    norms["num_tokens"],
                )
                if weights is not None:
                    folded_extra = None  # the pair term is not reweighted
            value, grad, stats = self._value_and_grad(
                token_logps.detach(),
                mask,
                lengths,
                advantages,
                old_token_logps,
                ref_token_logps,
                norms,
                folded_extra,
                weights,
            )
            stats.update(mismatch_stats)
            if extra_row_grad is not None and folded_extra is None:
                grad = grad.add_(completion_mask.to(grad.dtype) * extra_row_grad.unsqueeze(1))  # [N, T]
            if extra_value is not None:
                value = value + extra_value
                stats["loss"] = value
        loss = WithGrad.apply(token_logps, value, grad) if token_logps.requires_grad else value
        return LossOutput(loss=loss, stats=stats)

    def _value_and_grad(
        self,
        logps: torch.Tensor,
        mask: torch.Tensor,
        lengths: torch.Tensor,
        advantages: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        norms: dict[str, float],
        extra_row_grad: torch.Tensor | None = None,
        token_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Loss value, its gradient with respect to ``logps`` and the stats, in closed form (no autograd graph).

        With ``S = min(rho A, clip(rho) A)``, row weights ``w`` and mismatch weights ``m`` (1 without them):
            d loss / d logp_it = mask_it * m_it * w_i * (-rho A * [not clipped] + beta * (1 - exp(ref - logp)))
        which also holds for sequence ratios (rho and the clip test per row). On-policy rho = 1 and nothing clips.
        """
        weights = self._row_weights(lengths, norms)  # [N]
        wmask = mask if token_weights is None else mask * token_weights  # [N, T] mask_it * m_it
        adv = advantages.to(logps.dtype)  # [N]
        sign = adv.sign()  # [N]; rho > 0, so |S| = S * sign(A)
        if old is None:  # on-policy: rho == 1 exactly, S = A, nothing clips
            surrogate_rows = adv * (lengths if token_weights is None else wmask.sum(-1))  # [N] sum_t mask m S
            clipped_rows = torch.zeros_like(lengths)  # [N]
            coef = -adv.unsqueeze(1)  # [N, 1] d(-S)/d logp
        else:
            # In-place ops throughout: at [N, T] sizes every fresh allocation is another trip through memory.
            ratio = torch.sub(logps, old)  # [N, T] log-ratio
            if self.importance_sampling == "sequence":
                ratio = (torch.linalg.vecdot(ratio, mask) / lengths.clamp(min=1.0)).unsqueeze(1)  # [N, 1]
            ratio.exp_()  # [N, T] or [N, 1]
            coef = ratio * adv.unsqueeze(1)  # unclipped rho * A
            surrogate = ratio.clamp_(1.0 - self.epsilon, 1.0 + self.epsilon_high).mul_(adv.unsqueeze(1))
            is_clipped = coef > surrogate  # [N, T] or [N, 1]; the min picks the clipped branch
            torch.minimum(coef, surrogate, out=surrogate)  # S
            coef.masked_fill_(is_clipped, 0.0).neg_()  # d(-S)/d logp = -rho * A where not clipped
            if surrogate.shape[1] == 1:
                surrogate_rows = surrogate.squeeze(1) * wmask.sum(-1)  # [N]
                clipped_rows = is_clipped.squeeze(1) * lengths  # [N]
            else:
                surrogate_rows = torch.linalg.vecdot(surrogate, wmask)  # [N]
                clipped_rows = is_clipped.to(mask.dtype).mul_(mask).sum(-1)  # [N]
        pg_loss = -(weights * surrogate_rows).sum()
        stats = {"pg_loss": pg_loss}
        value = pg_loss
        # A mismatch weight multiplies its token's loss; a sequence ratio couples a row's tokens, so the row's
        # policy-gradient part reaches each of them with the row's mean weight (autograd of sum_t m_t * c(rho_seq)).
        pg_mask = wmask
        if token_weights is not None and self.importance_sampling == "sequence":
            pg_mask = mask * (wmask.sum(-1) / lengths.clamp(min=1.0)).unsqueeze(1)  # [N, T]
        kl_grad = None
        if self.beta != 0.0:
            delta = torch.sub(ref, logps)  # [N, T]
            exp_delta = delta.exp()  # [N, T]
            kl = (weights * torch.linalg.vecdot(delta.neg_().add_(exp_delta).sub_(1.0), wmask)).sum()  # k3
            stats["kl"] = kl
            value = value + self.beta * kl
            kl_coef = exp_delta.mul_(-self.beta).add_(self.beta)  # [N, T] beta * (1 - exp(delta))
            if token_weights is None:
                coef = kl_coef.add_(coef)  # [N, T] one masked pass for both terms
            else:
                kl_grad = kl_coef.mul_(wmask).mul_(weights.unsqueeze(1))  # [N, T]
        grad = coef * weights.unsqueeze(1)  # [N, T] or [N, 1]
        if extra_row_grad is not None:
            grad = grad.add_(extra_row_grad.unsqueeze(1))  # (a broadcasting addcmul is 2.5x slower on CPU)
        grad = grad.mul_(pg_mask) if grad.shape == pg_mask.shape else grad * pg_mask  # [N, T]
        if kl_grad is not None:
            grad = grad.add_(kl_grad)
        token_norm = max(norms["num_tokens"], 1.0)
        stats["clip_frac_low"] = (clipped_rows * (adv < 0)).sum() / token_norm
        stats["clip_frac_high"] = (clipped_rows * (adv > 0)).sum() / token_norm
        stats["clip_frac"] = clipped_rows.sum() / token_norm
        # Magnitude of the policy-gradient weights; the signed loss is ~0 on-policy (the official lambda divides by it).
        stats["pg_scale"] = (weights * surrogate_rows * sign).sum()
        stats["loss"] = value
        return value, grad, stats

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
    ) -> LossOutput:
        """Compute the loss of one micro-batch of whole groups.

        Args:
            token_logps: ``[N, T]`` log-probs of the sampled tokens under the current policy (with grad).
            completion_mask: ``[N, T]`` 1 on completion tokens.
            advantages: ``[N]`` group advantages.
            rewards: ``[N]`` raw rewards (unused here; subclasses mine pairs from them).
            group_size: ``G``.
            old_token_logps: ``[N, T]`` log-probs of the policy that sampled; ``None`` means on-policy (ratio 1).
            ref_token_logps: ``[N, T]`` reference log-probs, required when ``beta != 0``.
            truncated: ``[N]`` bool, completions cut by the length limit.
            num_sequences: Sequences in the whole step (default: this call's N).
            num_tokens: Policy-gradient tokens in the whole step (default: this call's).
            max_length: ``L`` of ``dr_grpo`` for the whole step (default: ``max_completion_length`` or T).
            sampling_token_logps: ``[N, T]`` the rollout engine's log-probs of the sampled tokens: enables the
                mismatch correction (``sampling_correction``) and the ``engine_kl`` stat.

        Returns:
            ``LossOutput`` with the loss and detached stats.
        """
        del rewards, group_size
        return self.policy_terms(
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
        )

    def end_step(self, step_stats: dict[str, torch.Tensor]) -> None:
        """Hook called once per optimisation step with the step's summed stats; GRPO keeps no state."""
