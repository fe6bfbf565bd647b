"""Group-relative advantages (GRPO, arXiv 2402.03300).

    A_i = (r_i - mean_G(r)) / (std_G(r) + eps)        std is unbiased (divides by G - 1), as TRL's GRPOTrainer

Rewards arrive as contiguous blocks of ``group_size`` completions of the same prompt.

Deliberate deviation: a group whose rewards are all equal gets advantage exactly 0 (the float mean of equal
values can differ from them by one ulp, which the 1e-4 epsilon would blow up to a spurious signal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

AdvantageScale = Literal["group", "batch", "none"]


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
