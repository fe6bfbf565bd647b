"""How a step's per-token losses are weighted: the normalisers of each aggregation mode, locally and across processes.

``grpo`` weights row i's tokens by 1 / (N |o_i|), ``dr_grpo`` by 1 / (N L), ``bnpo`` and ``dapo`` by 1 / (tokens of
the step); see ``policy.py`` for the formulas. The normalisers are computed once per optimisation step from every
completion of the step and passed to each micro-batch, which is what makes micro-batching exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def step_normalizers(
    completion_lengths: torch.Tensor,
    truncated: torch.Tensor | None,
    mask_truncated_completions: bool,
    max_completion_length: int | None,
) -> dict[str, float]:
    """``num_sequences``, ``num_tokens`` (tokens that enter the policy-gradient term) and ``max_length`` of a step.

    ``completion_lengths`` counts each completion's policy tokens (its loss mask's sum, ``RolloutStep.lengths``),
    so a tool's replies inside an episode count nowhere: not in ``num_tokens``, not in what dropping truncated
    completions takes away, not in the longest completion that stands in for ``max_completion_length``.
    """
    lengths = completion_lengths.float()
    if mask_truncated_completions and truncated is not None:
        lengths = lengths * (~truncated.bool()).float()
    max_length = max_completion_length or int(completion_lengths.max().item() if lengths.numel() else 1)
    return {
        "num_sequences": float(lengths.numel()),
        "num_tokens": float(lengths.sum().item()),
        "max_length": float(max(max_length, 1)),
    }


def global_normalizers(
    local: dict[str, float],
    world_size: int,
    all_reduce: Callable[[torch.Tensor, str], torch.Tensor],
    aggregation: str,
) -> dict[str, float]:
    """Normalisers of the step across ``world_size`` processes, from each process's ``step_normalizers``.

    Counts are summed and ``max_length`` maximised over processes, so every process's micro-batch losses are shares
    of one global loss; data-parallel training averages gradients over processes, so the caller scales its loss by
    ``world_size``. ``bnpo`` keeps a per-process token mean (TRL's semantics) averaged over the processes that have
    tokens this step: its token count is the local one times their number, which the scaling turns into that
    average (a process whose groups were all dropped, ``drop_zero_std_groups``, adds nothing and counts for
    nothing).

    Args:
        local: This process's normalisers.
        world_size: Number of processes.
        all_reduce: ``(tensor, op) -> tensor`` with ``op`` ``"sum"`` or ``"max"`` over processes.
        aggregation: The loss's aggregation mode.
    """
    if world_size == 1:
        return dict(local)
    keys = sorted(k for k in local if k != "max_length")
    summed = all_reduce(summed_counts(local), "sum").tolist()
    out = {k: float(v) for k, v in zip(keys, summed)}
    out["max_length"] = float(all_reduce(torch.tensor([local["max_length"]], dtype=torch.float64), "max")[0])
    if aggregation == "bnpo":
        out["num_tokens"] = local["num_tokens"] * max(summed[-1], 1.0)
    return out


def summed_counts(local: dict[str, float]) -> torch.Tensor:
    """What a process adds to the step's sums: its counts (sorted by name), then 1 if it has tokens."""
    keys = sorted(k for k in local if k != "max_length")
    return torch.tensor([local[k] for k in keys] + [float(local["num_tokens"] > 0)], dtype=torch.float64)


def row_weights(aggregation: str, lengths: torch.Tensor, norms: dict[str, float]) -> torch.Tensor:
    """``[N]`` weight of each token of row i in the step loss: ``loss = sum_i w_i sum_t mask_it c_it``."""
    if aggregation == "grpo":
        return 1.0 / (max(norms["num_sequences"], 1.0) * lengths.clamp(min=1.0))  # [N]
    if aggregation == "dr_grpo":
        return lengths.new_full(lengths.shape, 1.0 / max(norms["num_sequences"] * norms["max_length"], 1.0))
    return lengths.new_full(lengths.shape, 1.0 / max(norms["num_tokens"], 1.0))  # bnpo, dapo
