"""Unbiased pass@k (Chen et al. 2021) from per-problem correct counts, as a torchmetrics metric.

    pass@k = mean_i [1 - C(n - c_i, k) / C(n, k)]

computed as ``1 - prod_{j = n - c + 1}^{n} (1 - k / j)``, which never forms the huge binomials.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric
from typing_extensions import override


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: P(some of ``k`` samples drawn from ``n``, ``c`` correct, is correct)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= correct <= samples, got {c} correct of {n}")
    if k < 1 or k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n} (data.evaluation.samples)")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for j in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / j
    return 1.0 - prob_all_wrong


class PassAtK(Metric):
    """Mean unbiased pass@k over problems, for several k at once; sums reduce across processes.

    Args:
        ks: The k values.
    """

    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1, 2, 4)) -> None:
        super().__init__()
        if not ks or min(ks) < 1:
            raise ValueError(f"pass@k needs k >= 1, got {list(ks)}")
        self.ks = tuple(int(k) for k in ks)
        self.add_state("total", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor, samples: int) -> None:
        """``correct``: ``[P]`` correct counts out of ``samples`` per problem."""
        values = [[pass_at_k(samples, int(c), k) for k in self.ks] for c in correct.tolist()]
        self.total += torch.tensor(values, dtype=torch.float64, device=self.total.device).sum(0)
        self.problems += len(values)

    @override
    def compute(self) -> dict[int, torch.Tensor]:
        return {k: self.total[i] / self.problems.clamp(min=1) for i, k in enumerate(self.ks)}
