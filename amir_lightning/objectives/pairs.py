"""Implicit preference pairs mined from the reward ranking inside each rollout group (AMIR-GRPO, arXiv 2601.03661).

    S(q) = {(i, j) : i, j in the group of q,  r_i - r_j > margin}        strict, on raw (shaped) rewards

Fully vectorised: one ``[B, G, G]`` comparison, no Python loop over groups or pairs.

A group's pairs depend on its rewards alone, so a step mines its pairs once (``PairRule.mine``) and each of its
micro-batches finds those of its own groups in the result (``MinedGroups.find``).

Deliberate deviations from the official ``_build_contrastive_pairs``:
- ``top1`` picks the lowest index among tied best completions (the official ``argsort`` picks arbitrarily), so
  the result is deterministic.
- The cap ``max_pairs_per_group`` keeps the largest reward gaps; among equal gaps the lower (chosen, rejected)
  indices win.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from amir_lightning.objectives.advantages import _check_groups

PairMode = Literal["all", "top1"]


@dataclass(frozen=True)
class MinedGroups:
    """Groups and their pairs, mined once: a micro-batch of these groups finds its pairs here.

    Attributes:
        rewards: ``[B, G]`` each group's rewards.
        mask: ``BoolTensor[B, G, G]``, ``[b, i, j]`` true when (i, j) of group b is a pair.
    """

    rewards: torch.Tensor
    mask: torch.Tensor

    @property
    def count(self) -> int:
        """Number of pairs."""
        return int(self.mask.sum())

    def pairs(self) -> torch.Tensor:
        """``LongTensor[P, 2]`` of global (chosen, rejected) indices, ordered by group, then chosen, then rejected."""
        return mask_to_pairs(self.mask)

    def find(self, rewards: torch.Tensor, group_size: int) -> MinedGroups | None:
        """The groups of ``rewards`` ``[n]`` (whole groups, contiguous), on its device; ``None`` if one is not here.

        A group matches one here with the same rewards (NaN matching NaN), and so has its pairs.
        """
        G = self.rewards.shape[1]
        if group_size != G or rewards.dim() != 1 or rewards.dtype != self.rewards.dtype or rewards.numel() % G:
            return None
        query = rewards.detach().to(self.rewards.device).view(-1, 1, G)  # [b, 1, G]
        known = self.rewards.unsqueeze(0)  # [1, B, G]
        same = ((query == known) | (query.isnan() & known.isnan())).all(dim=2)  # [b, B]
        if not bool(same.any(dim=1).all()):
            return None
        index = same.to(torch.uint8).argmax(dim=1)  # [b] the first group with these rewards
        return MinedGroups(rewards.detach().view(-1, G), self.mask[index].to(rewards.device))


@dataclass(frozen=True)
class PairRule:
    """Which (chosen, rejected) pairs of a group are mined.

    Attributes:
        margin: A pair needs ``rewards[chosen] - rewards[rejected] > margin`` (strict). Must be ``>= 0``.
        mode: ``"all"`` takes every ordered pair over the margin (at most ``G(G-1)/2`` per group); ``"top1"``
            pairs the best completion of each group with each other one over the margin (at most ``G - 1``).
        max_pairs_per_group: If set, keep at most this many pairs per group, those with the largest gaps.
    """

    margin: float = 0.0
    mode: PairMode = "all"
    max_pairs_per_group: int | None = None

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0 so that pairs are strictly ordered, got {self.margin}")
        if self.mode not in ("all", "top1"):
            raise ValueError(f"mode must be 'all' or 'top1', got {self.mode!r}")
        if self.max_pairs_per_group is not None and self.max_pairs_per_group < 1:
            raise ValueError(f"max_pairs_per_group must be >= 1 or None, got {self.max_pairs_per_group}")

    def mine(self, rewards: torch.Tensor, group_size: int) -> MinedGroups:
        """The pairs within each group of ``group_size`` consecutive completions of ``rewards`` ``[N]``.

        A group with a NaN reward forms no pair at all.
        """
        _check_groups(rewards, group_size)
        G, cap = group_size, self.max_pairs_per_group
        grouped = rewards.detach().view(-1, G)  # [B, G]
        gaps = grouped.unsqueeze(2) - grouped.unsqueeze(1)  # [B, G, G] gap[b, i, j] = r_i - r_j
        # A group with a NaN reward carries no signal (its advantages are zeroed too): no pair among its finite members.
        valid = (gaps > self.margin) & grouped.isfinite().all(dim=1).view(-1, 1, 1)  # [B, G, G]
        if self.mode == "top1":
            best = torch.nan_to_num(grouped, nan=-torch.inf).argmax(dim=1)  # [B] first index among ties
            is_best = torch.arange(G, device=rewards.device) == best.unsqueeze(1)  # [B, G]
            valid &= is_best.unsqueeze(2)  # [B, G, G]
        if cap is not None and cap < G * G:
            scores = gaps.masked_fill(~valid, -torch.inf).view(-1, G * G)  # [B, G*G]
            order = scores.sort(dim=1, descending=True, stable=True).indices[:, :cap]  # [B, K]
            keep = torch.zeros_like(valid).view(-1, G * G)  # [B, G*G]
            keep.scatter_(1, order, valid.view(-1, G * G).gather(1, order))
            valid = keep.view_as(valid)  # [B, G, G]
        return MinedGroups(grouped, valid)


def mask_to_pairs(mask: torch.Tensor) -> torch.Tensor:
    """``LongTensor[P, 2]`` of the global (chosen, rejected) indices that a pair mask ``[B, G, G]`` marks."""
    group, chosen, rejected = mask.nonzero(as_tuple=True)  # [P] each
    offset = group * mask.shape[1]  # [P]
    return torch.stack([offset + chosen, offset + rejected], dim=1)  # [P, 2]


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
        margin: ``PairRule.margin``.
        mode: ``PairRule.mode``.
        max_pairs_per_group: ``PairRule.max_pairs_per_group``.

    Returns:
        ``LongTensor[P, 2]`` of global (chosen, rejected) indices, ordered by group, then chosen, then rejected.
    """
    return PairRule(margin, mode, max_pairs_per_group).mine(rewards, group_size).pairs()
