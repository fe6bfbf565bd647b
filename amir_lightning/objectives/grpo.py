"""GRPO's clipped policy-gradient objective with TRL GRPOTrainer's aggregation modes (arXiv 2402.03300).

    rho_i,t = exp(logp_i,t - old_i,t)                (token)   or  exp(mean_t(logp_i - old_i))  (sequence, GSPO)
    c_i,t   = -min(rho A_i, clip(rho, 1 - eps, 1 + eps_high) A_i) + kl_coef * k3_i,t
    k3      = exp(ref - logp) - (ref - logp) - 1

The policy term can be another surrogate (``policy_loss``): ``cispo`` ``-sg(min(rho, cispo_max)) A_i logp_i,t``
(MiniMax-M1, arXiv 2506.13585, as TRL 1.16), ``sapo`` ``-sigmoid(tau (rho - 1)) 4 / tau A_i`` (arXiv 2511.20347);
``clip`` may bound a negative advantage's loss at ``dual_clip * |A_i|`` (dual-clip PPO, arXiv 1912.09729).

Aggregation of the per-token loss ``c`` over one optimisation step of N completions:
    grpo     (1/N) sum_i (1/|o_i|) sum_t c_i,t              mean over sequences of the per-sequence token mean
    bnpo     sum_i,t c_i,t / sum_i |o_i|                    token mean over this process's step batch, then the
                                                            mean over processes
    dapo     sum_i,t c_i,t / sum_i |o_i|                    token mean over the global step batch (all processes)
    dr_grpo  sum_i,t c_i,t / (N * L)                        L = max_completion_length, a constant
|o_i| and every token count are the policy's own tokens (the loss mask; not a tool's replies inside an episode).

Micro-batches hold whole groups and share the step's ``StepContext`` (``num_sequences``, ``num_tokens``,
``max_length``, over all processes), so summing their losses gives exactly the full-batch loss and gradient. The
gradient is autograd's.

Engine/trainer mismatch (TRL's ``vllm_importance_sampling_correction``): the rollout engine samples with its own
kernels and dtype, so its distribution q differs slightly from the trainer's p_old. Given the engine's log-probs
of the sampled tokens, each token's loss is weighted by w = p_old / q, truncated at ``sampling_cap`` (``*_truncate``)
or zeroed above it (``*_mask``), per token or with one ratio per sequence (the product of its token ratios).
p_old is ``old_logps`` off-policy and the forward's own detached log-probs on-policy (no extra forward).
``sampling_floor`` bounds the weights from below, and ``off_policy_mask`` drops negative-advantage completions the
engine sampled far from the current policy (``objectives/mismatch.py``).
The k3 estimate of KL(q || p_old) per token is logged whether or not the correction is on. The weights apply to
the policy-gradient term only, as in TRL and verl: the KL penalty to the reference and the AMIR pair term are
regularisers of the current policy, not expectations under the sampling policy.

Deliberate deviations from TRL:
- ``bnpo`` normalises by the tokens of the process's whole step batch, not of each micro-batch: TRL's choice makes
  the gradient depend on the micro-batch size. On one process ``bnpo`` and ``dapo`` therefore coincide.
- Every stat is additive over the micro-batches of a step (its value is the micro-batch's share), so a step's
  stats are their sum; clip fractions are token fractions of the step.

Both losses report the step's mined pairs (``amir/num_pairs``, ``amir/pair_margin``, ``amir/pair_acc``): GRPO mines
them with the default rule (every pair with a reward gap) for measurement only, so GRPO and AMIR runs compare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.objectives.aggregation import global_normalizers, row_weights, step_normalizers
from amir_lightning.objectives.base import LossOutput, RowDiagnostics, StepContext
from amir_lightning.objectives.logprobs import sequence_logps
from amir_lightning.objectives.mismatch import mismatch_weights, off_policy_mask
from amir_lightning.objectives.pairs import PairRule

#: Where these arguments live in a YAML config, for error messages.
_KEY = "model.loss.init_args"
PolicyLoss = Literal["clip", "cispo", "sapo"]
KLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+"]


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token KL estimate ``estimator`` of the policy to the reference (``GRPOLoss.kl_estimator``)."""
    log_ratio = logps - ref_logps
    if estimator.startswith("k1"):
        value = log_ratio
    elif estimator == "k2":
        return 0.5 * log_ratio.square()
    else:  # k3
        value = (-log_ratio).exp() + log_ratio - 1.0
    if estimator.endswith("+"):  # k2's gradient, the estimate's value (straight-through)
        k2 = 0.5 * log_ratio.square()
        return k2 - k2.detach() + value.detach()
    return value


Aggregation = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSampling = Literal["token", "sequence"]
SamplingCorrection = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]
AllReduce = Callable[[torch.Tensor, str], torch.Tensor]


class GRPOLoss(nn.Module):
    """Clipped-surrogate GRPO loss over per-token log-probs.

    Args:
        aggregation: How token losses are reduced: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (module docstring).
        epsilon: Lower clip range, ``rho >= 1 - epsilon``.
        epsilon_high: Upper clip range ``rho <= 1 + epsilon_high`` (DAPO's clip-higher); defaults to ``epsilon``.
        importance_sampling: ``token`` ratios (GRPO) or one ``sequence`` ratio per completion (GSPO). On-policy
            (``old_logps=None``) both give the same gradient.
        kl_coef: Coefficient of the KL penalty to the reference policy (TRL's ``beta``); 0 needs no reference
            model.
        kl_estimator: The per-token KL estimate (Schulman's, as verl 0.9's ``kl_penalty``): ``k1`` ``logp - ref``,
            ``k2`` ``(logp - ref)^2 / 2``, ``k3`` ``exp(ref - logp) - (ref - logp) - 1`` (default; TRL's, verl's
            ``low_var_kl`` without its clamps), or ``k1+`` / ``k3+``: that value with ``k2``'s gradient
            (straight-through, an unbiased gradient of the KL).
        kl_importance_weighted: Weigh each token's KL by its ratio to the old policy (TRL's
            ``use_bias_correction_kl``, on there by default): the estimate of KL under the current policy from samples
            of the old one.
        mask_truncated_completions: Drop completions that hit the length limit from the policy-gradient term.
        max_completion_length: ``L`` of ``dr_grpo``: a constant, the completion's policy-token limit (``amir fit``
            sets it to ``data.sampling.max_new_tokens``, times the environment's ``max_turns`` for episodes, unless
            given; training without it is an error). ``None`` in a direct call: the longest completion of the call.
        sampling_correction: Importance weights for the engine/trainer mismatch (module docstring), or ``none``.
        sampling_cap: Largest importance weight kept (TRL's ``vllm_importance_sampling_clip_max``).
        sampling_floor: Smallest importance weight kept (TRL's ``vllm_importance_sampling_clip_min``): ``*_truncate``
            raises a smaller weight to it, ``*_mask`` drops the token or completion. ``None``: no lower bound.
        off_policy_mask: DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``): a
            completion with a negative advantage whose engine log-probs exceed the current policy's by more than this
            per token on average leaves the policy-gradient term (``objectives/mismatch.py``). ``None``: off.
        policy_loss: The policy term's per-token surrogate, maximised: ``clip`` (PPO's clipped ratio times the
            advantage); ``cispo`` (MiniMax-M1, arXiv 2506.13585, as TRL 1.16 has it: the ratio capped at
            ``cispo_max`` and detached, times the advantage and the token's log-prob, so no token loses its
            gradient); ``sapo`` (arXiv 2511.20347: a soft gate ``sigmoid(tau (ratio - 1)) 4 / tau`` times the
            advantage, ``tau`` = ``sapo_temperature_pos`` for a positive advantage, ``sapo_temperature_neg``
            otherwise). ``epsilon``, ``epsilon_high`` and ``dual_clip`` belong to ``clip``.
        cispo_max: ``cispo``'s cap on the ratio (TRL's ``epsilon_high`` under ``cispo``; 5.0 as it recommends).
        sapo_temperature_pos: ``sapo``'s gate temperature for a positive advantage (TRL's default 1.0).
        sapo_temperature_neg: ``sapo``'s gate temperature otherwise (TRL's default 1.05).
        dual_clip: Dual-clip PPO (arXiv 1912.09729; verl's ``clip_ratio_c``, 3.0 there): a token whose
            advantage is negative loses at most ``dual_clip * |A|``, however large its ratio grew (the clipped
            surrogate alone lets ``ratio * A`` fall without bound). ``None``: off. Must be > 1.
    """

    def __init__(
        self,
        aggregation: Aggregation = "grpo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        importance_sampling: ImportanceSampling = "token",
        kl_coef: float = 0.0,
        mask_truncated_completions: bool = False,
        max_completion_length: int | None = None,
        sampling_correction: SamplingCorrection = "token_truncate",
        sampling_cap: float = 3.0,
        dual_clip: float | None = None,
        policy_loss: PolicyLoss = "clip",
        cispo_max: float = 5.0,
        sampling_floor: float | None = None,
        off_policy_mask: float | None = None,
        kl_estimator: KLEstimator = "k3",
        kl_importance_weighted: bool = False,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
    ) -> None:
        super().__init__()
        errors = []
        check_number(errors, f"{_KEY}.dual_clip", dual_clip, gt=1, optional=True)
        if policy_loss not in ("clip", "cispo", "sapo"):
            errors.append(f"{_KEY}.policy_loss must be clip, cispo or sapo, got {policy_loss!r}")
        elif policy_loss != "clip" and dual_clip is not None:
            errors.append(f"{_KEY}.dual_clip bounds the clipped surrogate: it needs policy_loss clip, not "
                          f"{policy_loss}")  # fmt: skip
        check_number(errors, f"{_KEY}.cispo_max", cispo_max, gt=0)
        check_number(errors, f"{_KEY}.sampling_floor", sampling_floor, gt=0, lt=1, optional=True)
        check_number(errors, f"{_KEY}.off_policy_mask", off_policy_mask, ge=0, optional=True)
        if kl_estimator not in ("k1", "k2", "k3", "k1+", "k3+"):
            errors.append(f"{_KEY}.kl_estimator must be one of k1, k2, k3, k1+, k3+, got {kl_estimator!r}")
        check_number(errors, f"{_KEY}.sapo_temperature_pos", sapo_temperature_pos, gt=0)
        check_number(errors, f"{_KEY}.sapo_temperature_neg", sapo_temperature_neg, gt=0)
        if aggregation not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            errors.append(f"{_KEY}.aggregation must be one of grpo, bnpo, dr_grpo, dapo, got {aggregation!r}")
        if importance_sampling not in ("token", "sequence"):
            errors.append(f"{_KEY}.importance_sampling must be 'token' or 'sequence', got {importance_sampling!r}")
        if not 0 <= epsilon < 1:
            errors.append(f"{_KEY}.epsilon must be in [0, 1), got {epsilon}")
        check_number(errors, f"{_KEY}.epsilon_high", epsilon_high, ge=0, optional=True)
        check_number(errors, f"{_KEY}.kl_coef", kl_coef, ge=0)
        check_number(errors, f"{_KEY}.max_completion_length", max_completion_length, ge=1, optional=True)
        corrections = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
        if sampling_correction not in corrections:
            errors.append(
                f"{_KEY}.sampling_correction must be one of {', '.join(corrections)}, got {sampling_correction!r}"
            )
        check_number(errors, f"{_KEY}.sampling_cap", sampling_cap, ge=1)
        raise_errors(errors)
        self.sampling_correction, self.sampling_cap, self.dual_clip = sampling_correction, sampling_cap, dual_clip
        self.policy_loss, self.cispo_max = policy_loss, cispo_max
        self.sampling_floor, self.off_policy_mask = sampling_floor, off_policy_mask
        self.kl_estimator, self.kl_importance_weighted = kl_estimator, kl_importance_weighted
        self.sapo_temperatures = (sapo_temperature_pos, sapo_temperature_neg)
        self.aggregation = aggregation
        self.epsilon = epsilon
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.importance_sampling = importance_sampling
        self.kl_coef = kl_coef
        self.mask_truncated_completions = mask_truncated_completions
        self.max_completion_length = max_completion_length
        self.pair_rule = PairRule()  # which pairs it mines: GRPO's (every pair with a reward gap) are measured only

    @property
    def needs_reference(self) -> bool:
        """Whether ``ref_logps`` must be passed (a frozen reference model is needed)."""
        return bool(self.reference_uses())

    def reference_uses(self) -> list[str]:
        """The settings that need reference log-probs: the KL term's, and those of the terms a subclass adds."""
        return (["kl_coef != 0"] if self.kl_coef != 0.0 else []) + self.added_reference_uses()

    def added_reference_uses(self) -> list[str]:
        """The settings of the terms a subclass adds (``regularize``) that need reference log-probs (GRPO: none)."""
        return []

    @property
    def lambda_now(self) -> float:
        """Weight of the pair term in the coming step (GRPO has none)."""
        return 0.0

    def pairs(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """(chosen, rejected) pairs of ``rewards`` ``[N]`` as ``LongTensor[P, 2]`` (``pair_rule``)."""
        return self.pair_rule.mine(rewards, group_size).pairs()

    def step_context(
        self,
        completion_lengths: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        truncated: torch.Tensor | None = None,
        world_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> StepContext:
        """The ``StepContext`` of a step from all of its completions (on this process).

        Args:
            completion_lengths: ``[N]`` policy tokens (loss-mask sums, ``RolloutStep.lengths``) of each completion.
            rewards: ``[N]`` rewards of the step (pairs are mined from them).
            group_size: ``G``.
            truncated: ``[N]`` bool, completions that hit the length limit.
            world_size: Processes that share the step.
            all_reduce: ``(tensor, op) -> tensor`` with op ``"sum"`` or ``"max"`` over the processes, which
                combines their counts when ``world_size > 1`` (``aggregation.global_normalizers``).
        """
        local = step_normalizers(
            completion_lengths, truncated, self.mask_truncated_completions, self.max_completion_length
        )
        mined = self.pair_rule.mine(rewards, group_size)  # the step's pairs, mined once: its micro-batches find theirs
        local["num_pairs"] = float(mined.count)
        norms = global_normalizers(local, world_size, all_reduce, self.aggregation) if world_size > 1 else local
        return StepContext(**norms, lambda_=self.lambda_now, mined=mined)

    def forward(
        self,
        logps: torch.Tensor,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        rewards: torch.Tensor,
        group_size: int,
        old_logps: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        sampling_logps: torch.Tensor | None = None,
        context: StepContext | None = None,
    ) -> LossOutput:
        """The loss of one micro-batch of whole groups.

        Args:
            logps: ``[N, T]`` log-probs of the sampled tokens under the current policy (with grad).
            completion_mask: ``[N, T]`` the loss mask: 1 on the policy's own tokens (0 on a tool's replies, padding).
            advantages: ``[N]`` group advantages.
            rewards: ``[N]`` raw rewards (pairs are mined from them).
            group_size: ``G``.
            old_logps: ``[N, T]`` log-probs of the policy that sampled; ``None`` means on-policy (ratio 1).
            ref_logps: ``[N, T]`` reference log-probs, required when ``needs_reference``.
            truncated: ``[N]`` bool, completions cut by the length limit.
            sampling_logps: ``[N, T]`` the rollout engine's log-probs of the sampled tokens: enables the
                mismatch correction (``sampling_correction``) and the ``rollout/engine_trainer_kl`` stat.
            context: The step's ``StepContext``; default: this call is the whole step (``step_context``).

        Returns:
            ``LossOutput`` with the loss, its stats and the per-row diagnostics.
        """
        if self.needs_reference and ref_logps is None:
            uses = " and ".join(self.reference_uses())
            raise ValueError(f"{type(self).__name__} with {uses} needs ref_logps (a reference model)")
        if context is None:  # this call is the whole step
            context = self.step_context(completion_mask.sum(-1), rewards, group_size, truncated)
        pairs = self.micro_batch_pairs(rewards, group_size, context)  # [P, 2]
        loss, stats, pg_token_weight = self.policy_gradient(
            logps, completion_mask, advantages, old_logps, ref_logps, truncated,
            sampling_logps, context,
        )  # fmt: skip
        seq = sequence_logps(logps.detach(), completion_mask, "mean")  # [N]
        stats.update(pair_stats(seq, pairs, rewards, context.num_pairs))
        out = LossOutput(loss, stats, RowDiagnostics(seq, pg_token_weight, pairs))
        return self.regularize(out, logps, completion_mask, ref_logps, context)

    def micro_batch_pairs(self, rewards: torch.Tensor, group_size: int, context: StepContext) -> torch.Tensor:
        """``LongTensor[P, 2]`` the pairs of a micro-batch's groups, found among the step's (mined once).

        A micro-batch whose groups are not among the step's (a filler) mines its own.
        """
        found = context.mined.find(rewards, group_size) if context.mined is not None else None
        return (self.pair_rule.mine(rewards, group_size) if found is None else found).pairs()

    def regularize(
        self, out: LossOutput, logps: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor | None, context: StepContext
    ) -> LossOutput:
        """The micro-batch's output ``out`` with the terms a subclass adds to the policy gradient's (GRPO: none).

        Args:
            out: The micro-batch's output so far (its ``rows.pairs`` are its pairs).
            logps: ``[N, T]`` the forward's log-probs (with grad).
            mask: ``[N, T]`` its ``completion_mask``.
            ref: ``[N, T]`` its ``ref_logps``, or ``None``.
            context: The step's ``StepContext``.
        """
        del logps, mask, ref, context
        return out

    def trained_tokens(self, completion_mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
        """``[N, T]`` the policy-gradient term's tokens, those the step's ``num_tokens`` counts.

        The loss mask (the policy's own tokens), less truncated completions with ``mask_truncated_completions``.
        """
        if self.mask_truncated_completions and truncated is not None:
            return completion_mask * (~truncated.bool()).to(completion_mask.dtype).unsqueeze(1)
        return completion_mask

    def policy_gradient(
        self,
        logps: torch.Tensor,
        completion_mask: torch.Tensor,
        advantages: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        truncated: torch.Tensor | None,
        sampling_logps: torch.Tensor | None,
        context: StepContext,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The policy term (``policy_loss``'s surrogate) and the k3 KL, aggregated with the step's normalisers.

        Returns:
            The term, its stats, and ``[N]`` the gradient weight each token of a row gets from it (``|A_i| w_i``).
        """
        mask = self.trained_tokens(completion_mask, truncated).to(logps.dtype)  # [N, T]
        lengths = mask.sum(-1)  # [N]
        weights = row_weights(self.aggregation, lengths, vars(context)).detach()  # [N] per-token weight of row i
        token_weights, stats = mask, {}
        if sampling_logps is not None:
            old = logps if old_logps is None else old_logps  # [N, T] p_old
            corrected, stats = mismatch_weights(
                old, sampling_logps, mask, self.sampling_correction, self.sampling_cap, context.num_tokens,
                self.sampling_floor,
            )  # fmt: skip
            token_weights = mask if corrected is None else corrected  # [N, T] mask * importance weight
            if self.off_policy_mask is not None:  # the engine sampled these far from the current policy
                keep = off_policy_mask(advantages.to(logps.dtype), logps, sampling_logps, mask, self.off_policy_mask)
                token_weights = token_weights * keep
                stats["train/off_policy_masked_frac"] = ((1.0 - keep) * mask).sum().detach() / max(
                    context.num_tokens, 1.0
                )
        adv = advantages.to(logps.dtype).unsqueeze(1)  # [N, 1]
        old = logps.detach() if old_logps is None else old_logps
        log_ratio = logps - old  # [N, T]; zero on-policy, with the gradient of logp
        if self.importance_sampling == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / lengths.clamp(min=1.0)).unsqueeze(1)  # [N, 1]
        ratio = log_ratio.exp()
        if self.policy_loss == "cispo":  # the capped ratio weighs the log-prob's gradient: no token is cut off
            capped = ratio.clamp(max=self.cispo_max).detach()
            surrogate = capped * adv * logps  # [N, T]
        elif self.policy_loss == "sapo":  # a soft gate in place of the hard clip
            tau = torch.where(adv > 0, self.sapo_temperatures[0], self.sapo_temperatures[1]).to(logps.dtype)
            surrogate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # [N, T] (or [N, 1] per sequence)
        else:
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - self.epsilon, 1.0 + self.epsilon_high) * adv)
        if self.dual_clip is not None:  # a negative advantage's surrogate bounded below by dual_clip * A
            dual = torch.maximum(surrogate, self.dual_clip * adv)
            dual_clipped = ((dual > surrogate) & (adv < 0)).to(mask.dtype).expand_as(mask) * mask  # [N, T]
            surrogate = torch.where(adv < 0, dual, surrogate)
        token_loss = -surrogate * token_weights  # [N, T]
        pg_loss = (weights * token_loss.sum(-1)).sum()
        loss = pg_loss
        with torch.no_grad():
            if self.policy_loss == "clip":
                clipped = (ratio * adv > surrogate).to(mask.dtype).expand_as(mask) * mask  # [N, T]
            elif self.policy_loss == "cispo":  # the tokens whose weight was capped
                clipped = (ratio > self.cispo_max).to(mask.dtype).expand_as(mask) * mask
            else:  # no hard clip
                clipped = torch.zeros_like(mask)
            token_norm = max(context.num_tokens, 1.0)
            stats["train/pg_loss"] = pg_loss.detach()
            stats["train/clip_frac"] = clipped.sum() / token_norm
            stats["train/clip_frac_low"] = (clipped.sum(-1) * (advantages < 0)).sum() / token_norm
            stats["train/clip_frac_high"] = (clipped.sum(-1) * (advantages > 0)).sum() / token_norm
            if self.dual_clip is not None:
                stats["train/dual_clip_frac"] = dual_clipped.sum() / token_norm
            # Magnitude of the policy-gradient weights; the signed loss is ~0 on-policy (the official lambda uses it).
            # (cispo's gradient is the capped ratio times |A| on each token's log-prob, whatever its value)
            magnitude = capped * adv.abs() if self.policy_loss == "cispo" else surrogate * adv.sign()  # [N, T|1]
            stats["train/pg_scale"] = (weights * (magnitude * token_weights).sum(-1)).sum()
        if self.kl_coef != 0.0:
            per_token = kl_estimate(logps, ref_logps.to(logps.dtype), self.kl_estimator)  # [N, T]
            if self.kl_importance_weighted:  # TRL's bias correction: the ratio, with its gradient
                per_token = per_token * ratio
            kl = (weights * (per_token * mask).sum(-1)).sum()
            loss = loss + self.kl_coef * kl
            stats["train/kl"] = kl.detach()
        stats["train/loss"] = loss.detach()
        return loss, stats, (advantages.abs() * weights).detach()

    def end_step(self, step_stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """Once per optimisation step, with the step's summed stats: what the loss adds to the step's log.

        GRPO keeps no state, and adds nothing.
        """
        del step_stats
        return {}


def pair_stats(
    seq_logps: torch.Tensor, pairs: torch.Tensor, rewards: torch.Tensor, num_pairs: float
) -> dict[str, torch.Tensor]:
    """This micro-batch's share of the step's pair statistics (pooled over the step's ``num_pairs``).

    ``pair_margin`` is ``l(chosen) - l(rejected)`` with mean token log-probs, the paper's Figure 4 measure, and
    ``pair_acc`` the share of pairs where it is positive.
    """
    chosen, rejected = pairs[:, 0], pairs[:, 1]
    margins = seq_logps[chosen] - seq_logps[rejected]  # [P]
    denom = max(num_pairs, 1.0)
    return {
        "amir/num_pairs": seq_logps.new_tensor(float(pairs.shape[0])),
        "amir/pair_margin": margins.sum() / denom,
        "amir/pair_acc": (margins > 0).sum().to(seq_logps.dtype) / denom,
        "amir/pair_reward_gap": (rewards[chosen] - rewards[rejected]).sum().to(seq_logps.dtype) / denom,
    }
