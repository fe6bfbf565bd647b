"""Math answer correctness, graded by math-verify inside the sandbox (a hard timeout per answer)."""

from __future__ import annotations

from collections.abc import Sequence

from typing_extensions import override

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.grading import grade_answer
from amir_lightning.rewards.sandbox import SandboxedGrader


class MathAnswerReward(Reward):
    r"""``correct_score`` if the completion's final answer equals the reference, else ``wrong_score``.

    The final answer is the last ``\boxed{}``, else the last ``<answer>`` tag, else ``#### N``, else (with
    ``fallback_last_number``) the last number in the text; equality is math-verify's (``1/2 == 0.5``).

    Args:
        weight: Multiplier in the total reward.
        correct_score: Score of a correct answer (the official code uses 2.0).
        wrong_score: Score of a wrong or missing answer.
        fallback_last_number: Accept the last number of the text when no answer markup is present.
        timeout_s: Wall-clock limit per answer in the sandbox; an answer over it scores ``wrong_score``.
        num_workers: Grading worker processes; by default this process's share of the cores, less one, at most 8.
        memory_mb: Memory a worker may map beyond what it holds once started (its grader imported).
        name: Metric name (default ``math_answer``).
    """

    needs_reference = True

    def __init__(
        self,
        weight: float = 1.0,
        correct_score: float = 1.0,
        wrong_score: float = 0.0,
        fallback_last_number: bool = True,
        timeout_s: float = 5.0,
        num_workers: int | None = None,
        memory_mb: int | None = 2048,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        errors: list[str] = []
        key = "data.rewards: MathAnswerReward"
        check_number(errors, f"{key}.correct_score", correct_score)
        check_number(errors, f"{key}.wrong_score", wrong_score)
        check_number(errors, f"{key}.timeout_s", timeout_s, gt=0)
        check_number(errors, f"{key}.num_workers", num_workers, ge=1, optional=True)
        check_number(errors, f"{key}.memory_mb", memory_mb, ge=64, optional=True)
        raise_errors(errors)
        self.correct_score, self.wrong_score = correct_score, wrong_score
        self.fallback_last_number = fallback_last_number
        self.grader = SandboxedGrader(timeout_s, num_workers, memory_mb, timeout_score=0.0)

    def correctness(
        self, completions: Sequence[str], answers: Sequence[str], progress: str | None = None
    ) -> list[float]:
        """1.0 / 0.0 per completion; ``progress`` labels a progress bar over them (none when ``None``)."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        args = [(c, a, self.fallback_last_number) for c, a in zip(completions, answers)]
        return self.grader.map(grade_answer, args, progress)

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """``correct_score`` or ``wrong_score``; ``None`` (does not apply) where the prompt has no reference."""
        graded = [i for i, a in enumerate(answers) if a.strip()]
        correct = self.correctness([completions[i] for i in graded], [answers[i] for i in graded]) if graded else []
        out: list[float | None] = [None] * len(completions)
        for i, ok in zip(graded, correct):
            out[i] = self.correct_score if ok == 1.0 else self.wrong_score
        return out

    @override
    def close(self) -> None:
        self.grader.close()
