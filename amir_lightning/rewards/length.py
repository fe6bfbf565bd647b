"""A correctness reward with a length rule: a controlled length bias between correct and wrong completions.

The AMIR-GRPO paper (arXiv 2601.03661, abstract) argues that GRPO's per-sequence normalisation dilutes the penalty
on long wrong completions and that the pair term counters it. To test that where it must show, this reward makes
length and correctness depend on each other by construction: with ``correct_when: short`` a right answer counts
only in a completion of at most ``threshold_tokens`` tokens, so every long completion is wrong; ``long`` is the
reverse. ``configs/length_bias.yaml`` and ``benchmarks/science.py`` use it (docs/science.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.math import MathAnswerReward


class LengthControlledAnswerReward(MathAnswerReward):
    """``MathAnswerReward`` whose correct answers must also be short (or long): ``correct_score`` or ``wrong_score``.

    The length is the completion's token count (its end-of-sequence token included). The rollout's correctness (for
    the length and pair monitors) is this reward's, as for any ``MathAnswerReward``.

    Args:
        threshold_tokens: Longest "short" completion, in tokens.
        correct_when: ``short``: a right answer counts when the completion has at most ``threshold_tokens`` tokens;
            ``long``: when it has more.
        kwargs: ``MathAnswerReward``'s (``weight``, ``correct_score``, ``wrong_score``, ...).
    """

    def __init__(self, threshold_tokens: int = 4, correct_when: Literal["short", "long"] = "short", **kwargs) -> None:
        errors: list[str] = []
        key = "data.rewards: LengthControlledAnswerReward"
        check_number(errors, f"{key}.threshold_tokens", threshold_tokens, ge=1)
        if correct_when not in ("short", "long"):
            errors.append(f"{key}.correct_when must be short or long, got {correct_when!r}")
        raise_errors(errors)
        super().__init__(**kwargs)
        self.threshold_tokens, self.correct_when = threshold_tokens, correct_when

    def allowed(self, length: int) -> bool:
        """Whether a right answer counts in a completion of ``length`` tokens."""
        short = length <= self.threshold_tokens
        return short if self.correct_when == "short" else not short

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """As ``MathAnswerReward.score``, with right answers outside the length rule scored ``wrong_score``."""
        ids = kwargs.get("completion_ids")
        if ids is None or len(ids) != len(completions):
            raise ValueError("LengthControlledAnswerReward needs the completions' token ids (completion_ids)")
        graded = super().score(completions, answers)
        return [
            self.wrong_score if value == self.correct_score and not self.allowed(len(tokens)) else value
            for value, tokens in zip(graded, ids)
        ]
