"""The reward seam: each reward is a small class whose knobs are its own constructor arguments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from amir_lightning.validation import check_number, raise_errors


class Reward(ABC):
    """Scores completions; the rollout combines rewards as a weighted sum and logs each as ``rollout/reward/<name>``.

    Args:
        weight: Multiplier of this reward in the total.
        name: Metric name; defaults to the class name without the ``Reward`` suffix, in snake case.
    """

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        errors: list[str] = []
        check_number(errors, f"data.rewards: {type(self).__name__}.weight", weight)
        raise_errors(errors)
        self.weight = float(weight)
        self.name = name or _snake(type(self).__name__.removesuffix("Reward"))

    @abstractmethod
    def score(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """One float per completion; ``answers[i]`` is the reference answer of completion ``i``'s prompt."""

    def close(self) -> None:  # noqa: B027 (optional hook: most rewards hold nothing)
        """Release resources (worker processes)."""


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out) or "reward"
