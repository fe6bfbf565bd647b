"""Importance weights for the mismatch between the rollout engine and the trainer (TRL's vLLM IS correction).

    log w_t = log p_old(y_t) - log q(y_t)        q: the engine that sampled; p_old: the trainer's policy that sampled
    token_*     w_t per token                    sequence_*  one w = prod_t w_t per completion
    *_truncate  min(max(w, floor), cap)          *_mask      0 where w > cap or w < floor
                (``floor``: TRL's ``vllm_importance_sampling_clip_min``; none by default)

``off_policy_mask`` is DeepSeek-V3.2's off-policy sequence mask as TRL 1.16 has it (``off_policy_mask_threshold``):
a completion with a negative advantage whose mean per-token ``log q - log p`` (the engine's log-probs against the
current policy's) exceeds the threshold leaves the policy-gradient term.

``rollout/engine_trainer_kl`` is the k3 estimate of KL(q || p_old) per token, (w - 1) - log w averaged over the
sampled tokens: zero when the engine computes exactly what the trainer does, and growing when it drifts (other
kernels, another dtype, or stale weights).
"""

from __future__ import annotations

import torch


def mismatch_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    num_tokens: float,
    floor: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token importance weights ``[N, T]`` (``None`` for mode ``none``) and the mismatch stats.

    Args:
        old_logps: ``[N, T]`` the trainer's log-probs of the sampled tokens under the old policy, the weights
            that sampled them (the ratios' denominator; the current log-probs, detached, on-policy).
        sampling_logps: ``[N, T]`` the engine's log-probs of the same tokens.
        mask: ``[N, T]`` tokens that enter the loss.
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate``, ``sequence_mask`` or ``none``.
        cap: Largest weight kept.
        floor: Smallest weight kept (``None``: no lower bound).
        num_tokens: Token count of the whole step (the stats are this micro-batch's share of it).
    """
    with torch.no_grad():
        # A token the engine could not score (NaN) gets ratio 1: no correction rather than a NaN loss.
        log_ratio = (old_logps.detach() - sampling_logps.to(old_logps.dtype)).nan_to_num_(0.0)
        log_ratio = log_ratio.mul_(mask)  # [N, T]
        norm = max(num_tokens, 1.0)
        stats = {"rollout/engine_trainer_kl": (log_ratio.exp() - 1.0 - log_ratio).mul_(mask).sum() / norm}
        if mode == "none":
            return None, stats
        if mode.startswith("sequence"):
            log_ratio = log_ratio.sum(-1, keepdim=True)  # [N, 1] log of the product of token ratios
        ratio = log_ratio.clamp(max=80.0).exp_()  # [N, T] or [N, 1]; exp(80) is far above any cap, never inf
        over = ratio > cap  # [N, T] or [N, 1]
        if floor is not None:
            over |= ratio < floor
        low = 0.0 if floor is None else floor
        weights = ratio.clamp_(min=low, max=cap) if mode.endswith("truncate") else ratio.masked_fill_(over, 0.0)
        weights = weights.expand_as(mask) * mask  # [N, T]
        stats["train/is_weight_mean"] = weights.sum() / norm
        stats["train/is_capped_frac"] = over.expand_as(mask).to(mask.dtype).mul(mask).sum() / norm
    return weights, stats


def off_policy_mask(
    advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """``[N, 1]``: 0 for a completion with a negative advantage whose mean ``log q - log p`` exceeds ``threshold``.

    ``logps`` the current policy's (detached), ``sampling_logps`` the engine's; a token the engine could not score
    (NaN) counts 0. DeepSeek-V3.2's off-policy sequence mask, as TRL 1.16's ``get_off_policy_mask``.
    """
    with torch.no_grad():
        gap = (sampling_logps.to(logps.dtype) - logps.detach()).nan_to_num(0.0) * mask  # [N, T]
        mean = gap.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [N, 1]
        keep = (advantages.unsqueeze(1) >= 0) | (mean <= threshold)
    return keep.to(mask.dtype)
