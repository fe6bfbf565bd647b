"""Implicit preference pairs mined from the reward ranking inside each rollout group (AMIR-GRPO, arXiv 2601.03661).

    S(q) = {(i, j) : i, j in the group of q,  r_i - r_j > margin}        strict, on raw (shaped) rewards

Fully vectorised: one ``[B, G, G]`` comparison, no Python loop over groups or pairs.

Deliberate deviations from the official ``_build_contrastive_pairs``:
- ``top1`` picks the lowest index among tied best completions (the official ``argsort`` picks arbitrarily), so
  the result is deterministic.
- The cap ``max_pairs_per_group`` keeps the largest reward gaps; among equal gaps the lower (chosen, rejected)
  indices win.
"""

from __future__ import annotations

from typing import Literal

import torch

from amir_lightning.objectives.advantages import _check_groups

PairMode = Literal["all", "top1"]


def pair_mask(
    rewards: torch.Tensor,
    group_size: int,
    margin: float = 0.0,
    mode: PairMode = "all",
    max_pairs_per_group: int | None = None,
) -> torch.Tensor:
    """Dense form of ``mine_pairs``: ``BoolTensor[B, G, G]``, ``[b, i, j]`` true when (i, j) of group b is a pair."""
    return pair_mask_and_gaps(rewards, group_size, margin, mode, max_pairs_per_group)[0]


def pair_mask_and_gaps(
    rewards: torch.Tensor,
    group_size: int,
    margin: float = 0.0,
    mode: PairMode = "all",
    max_pairs_per_group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_mask`` and the reward gaps ``[B, G, G]`` (``r_i - r_j``) it was mined from."""
    _check_groups(rewards, group_size)
    if margin < 0:
        raise ValueError(f"margin must be >= 0 so that pairs are strictly ordered, got {margin}")
    if mode not in ("all", "top1"):
        raise ValueError(f"mode must be 'all' or 'top1', got {mode!r}")
    if max_pairs_per_group is not None and max_pairs_per_group < 1:
        raise ValueError(f"max_pairs_per_group must be >= 1 or None, got {max_pairs_per_group}")
    G = group_size
    grouped = rewards.detach().view(-1, G)  # [B, G]
    gaps = grouped.unsqueeze(2) - grouped.unsqueeze(1)  # [B, G, G] gap[b, i, j] = r_i - r_j
    # A group with a NaN reward carries no signal (its advantages are zeroed too): no pair among its finite members.
    valid = (gaps > margin) & grouped.isfinite().all(dim=1).view(-1, 1, 1)  # [B, G, G]
    if mode == "top1":
        best = torch.nan_to_num(grouped, nan=-torch.inf).argmax(dim=1)  # [B] first index among ties
        is_best = torch.arange(G, device=rewards.device) == best.unsqueeze(1)  # [B, G]
        valid &= is_best.unsqueeze(2)  # [B, G, G]
    if max_pairs_per_group is not None and max_pairs_per_group < G * G:
        scores = gaps.masked_fill(~valid, -torch.inf).view(-1, G * G)  # [B, G*G]
        order = scores.sort(dim=1, descending=True, stable=True).indices[:, :max_pairs_per_group]  # [B, K]
        keep = torch.zeros_like(valid).view(-1, G * G)  # [B, G*G]
        keep.scatter_(1, order, valid.view(-1, G * G).gather(1, order))
        valid = keep.view_as(valid)  # [B, G, G]
    return valid, gaps


def mine_pairs(
    rewards: torch.Tensor,
    group_size: int,
    margin: float = 0.0,
    mode: PairMode = "all",
    max_pairs_per_group: int | None = None,
) -> torch.Tensor:
    """Mine (chosen, rejected) pairs within each group of ``group_size`` consecutive completions.

    Args:
        rewards: ``[N]`` raw rewards, groups contiguous. A group with a NaN reward forms no pair at all.
        group_size: ``G``.
        margin: A pair needs ``rewards[chosen] - rewards[rejected] > margin`` (strict). Must be ``>= 0``.
        mode: ``"all"`` takes every ordered pair over the margin (at most ``G(G-1)/2`` per group); ``"top1"``
            pairs the best completion of each group with each other one over the margin (at most ``G - 1``).
        max_pairs_per_group: If set, keep at most this many pairs per group, those with the largest gaps.

    Returns:
        ``LongTensor[P, 2]`` of global (chosen, rejected) indices, ordered by group, then chosen, then rejected.
    """
    valid = pair_mask(rewards, group_size, margin, mode, max_pairs_per_group)  # [B, G, G]
    group, chosen, rejected = valid.nonzero(as_tuple=True)  # [P] each
    offset = group * group_size  # [P]
    return torch.stack([offset + chosen, offset + rejected], dim=1)  # [P, 2]
