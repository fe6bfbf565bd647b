"""Advantages from a rollout's rewards: group-relative (GRPO), leave-one-out (RLOO) and REINFORCE++.

    grpo      A_i = (r_i - mean_G(r)) / (std_G(r) + eps)    GRPO, arXiv 2402.03300; std unbiased, as TRL's GRPOTrainer
    rloo      A_i = r_i - mean_{j != i in G}(r_j)           RLOO, arXiv 2402.14740; TRL's RLOOTrainer
    reinforce_pp            A_i = whiten_tokens(r_i)                     REINFORCE++, arXiv 2501.03262
    reinforce_pp_baseline   A_i = whiten_tokens(r_i - mean_G(r))         REINFORCE++-baseline (same paper)

``whiten_tokens`` standardises over every trained token of the global batch (all processes): a completion's value
counts once per token it trains, with the unbiased variance, ``(x - mean) / sqrt(var + 1e-8)``, as verl 0.9's
``masked_whiten`` over the response mask (``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` in ``verl/trainer/ppo/core_algos.py``, outcome rewards,
gamma 1). ``grpo`` and ``rloo`` then scale as ``scale`` says (``rloo`` with ``none`` is TRL's RLOO default).

Rewards arrive as contiguous blocks of ``group_size`` completions of the same prompt.

Deliberate deviation: a group whose rewards are all equal gets advantage exactly 0 (the float mean of equal
values can differ from them by one ulp, which the 1e-4 epsilon would blow up to a spurious signal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

AdvantageScale = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
#: What verl adds to the variance before its square root when it whitens (``masked_whiten``).
WHITEN_EPS = 1e-8


def _check_groups(rewards: torch.Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide the number of completions N={rewards.numel()}")


def batch_std(rewards: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Unbiased std of the finite ``rewards`` of the whole batch, across processes when ``all_reduce`` sums over them.

    Each process passes its own rollout's rewards; ``all_reduce`` sums ``[count, sum, sum of squares]`` (float64).
    A NaN reward (a broken reward function) is left out rather than turning every advantage into NaN.
    """
    finite = rewards[rewards.isfinite()].double()  # [n]
    stats = torch.stack([finite.new_tensor(float(finite.numel())), finite.sum(), finite.square().sum()])  # [3]
    count, total, squares = (all_reduce(stats) if all_reduce is not None else stats).tolist()
    if count < 2:
        return 0.0
    return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
    std: float | None = None,
) -> torch.Tensor:
    """Standardise rewards within each group of ``group_size`` consecutive completions.

    Args:
        rewards: Scalar rewards, ``[N]`` with ``N = B * G``; groups are contiguous.
        group_size: ``G``, completions per prompt.
        scale: ``"group"`` divides by the group's std, ``"batch"`` by the std of all rewards (TRL's
            ``scale_rewards="batch"``), ``"none"`` only centres (Dr. GRPO).
        eps: Added to the std before dividing.
        std: For ``"batch"``, the batch's std when the batch spans processes (``batch_std``); default: the std of
            ``rewards``.

    Returns:
        Advantages ``[N]`` in ``float32`` (or the input's float dtype if wider).
    """
    _check_groups(rewards, group_size)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.to(dtype).view(-1, group_size)  # [B, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [B, G]
    flat = (grouped.amax(dim=1) == grouped.amin(dim=1)).unsqueeze(1)  # [B, 1] all-equal groups
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])  # [B, 1]
        advantages = centred / (std + eps)  # [B, G]
    elif scale == "batch":
        std = batch_std(rewards) if std is None else std
        advantages = centred / (std + eps)  # [B, G]
    elif scale == "none":
        advantages = centred  # [B, G]
    else:
        raise ValueError(f"scale must be one of 'group', 'batch', 'none', got {scale!r}")
    return advantages.masked_fill(flat, 0.0).view(-1)  # [N]


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, scale: AdvantageScale = "none", eps: float = 1e-4, std: float | None = None
) -> torch.Tensor:
    """Leave-one-out advantages: each reward minus the mean of the other ``group_size - 1`` of its group.

    RLOO (arXiv 2402.14740): ``r_i - (sum_G(r) - r_i) / (G - 1)``, which is ``G / (G - 1)`` times GRPO's
    centred reward. ``scale`` then divides by the group's or the batch's std as for ``group_advantages``. A group
    whose rewards are all equal gets exactly 0.
    """
    _check_groups(rewards, group_size)
    if group_size < 2:
        raise ValueError("rloo needs groups of at least 2 completions (each reward's baseline is the others' mean)")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.to(dtype).view(-1, group_size)  # [B, G]
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    advantages = grouped - others  # [B, G]
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / ((batch_std(rewards) if std is None else std) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be one of 'group', 'batch', 'none', got {scale!r}")
    flat = (grouped.amax(dim=1) == grouped.amin(dim=1)).unsqueeze(1)  # [B, 1]
    return advantages.masked_fill(flat, 0.0).view(-1)  # [N]


def whiten_tokens(
    values: torch.Tensor,
    tokens: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``values`` (one per completion) standardised over the trained tokens of the whole batch, across processes.

    Each completion's value counts ``tokens[i]`` times: ``mean = sum(n x) / sum(n)``, ``var = sum(n (x - mean)^2) /
    (sum(n) - 1)``, and ``(x - mean) / sqrt(var + 1e-8)`` (verl's ``masked_whiten``, module docstring).
    ``all_reduce`` sums ``[tokens, sum n x, sum n x^2]`` (float64) over processes. A non-finite value is left out of
    the statistics (and stays non-finite). Fewer than 2 tokens: only centred.
    """
    x, n = values.double(), tokens.double()
    finite = x.isfinite()
    xf, nf = x.where(finite, 0.0), n.where(finite, 0.0)
    stats = torch.stack([nf.sum(), (nf * xf).sum(), (nf * xf * xf).sum()])  # [3]
    count, total, squares = (all_reduce(stats) if all_reduce is not None else stats).tolist()
    if count <= 0:
        return torch.zeros_like(values, dtype=torch.promote_types(values.dtype, torch.float32))
    mean = total / count
    var = max(squares - count * mean * mean, 0.0) / (count - 1) if count > 1 else 0.0
    scale = (var + WHITEN_EPS) ** -0.5 if count > 1 else 1.0
    return ((x - mean) * scale).to(torch.promote_types(values.dtype, torch.float32))


def estimate_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: AdvantageEstimator = "grpo",
    scale: AdvantageScale = "group",
    tokens: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The advantages ``estimator`` gives ``rewards`` ``[N]`` (module docstring).

    ``tokens`` ``[N]``: each completion's trained tokens (the REINFORCE++ estimators whiten over them);
    ``all_reduce`` sums a tensor over processes (the batch statistics span them).
    """
    if estimator in ("grpo", "rloo"):
        std = batch_std(rewards, all_reduce) if scale == "batch" else None
        pick = group_advantages if estimator == "grpo" else rloo_advantages
        return pick(rewards, group_size, scale, std=std)
    if estimator not in ESTIMATORS:
        raise ValueError(f"the advantage estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if tokens is None:
        raise ValueError(f"{estimator} whitens over the trained tokens: pass each completion's token count")
    _check_groups(rewards, group_size)
    values = rewards.double()
    if estimator == "reinforce_pp_baseline":
        grouped = values.view(-1, group_size)  # [B, G]
        values = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # [N]
    return whiten_tokens(values, tokens, all_reduce).to(torch.promote_types(rewards.dtype, torch.float32))
