"""Format rewards for the paper's ``<think>...</think><answer>...</answer>`` output format (official code)."""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Sequence

from typing_extensions import override

from amir_lightning.rewards.base import Reward

_STRICT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_DIGIT = re.compile(r"\d")


class _CheckReward(Reward):
    """``score`` for each completion that passes the subclass's ``passes`` check, else 0."""

    def __init__(self, weight: float, score: float, name: str | None) -> None:
        super().__init__(weight, name)
        self.value = score

    @abstractmethod
    def passes(self, completion: str) -> bool:
        """Whether ``completion`` earns the score."""

    @override
    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float]:
        return [self.value if self.passes(c) else 0.0 for c in completions]


class ThinkAnswerFormatReward(_CheckReward):
    """``score`` if the whole completion is ``<think>...</think>`` then ``<answer>...</answer>``, else 0.

    Stricter than the official regex, whose ``re.MULTILINE`` let trailing lines after ``</answer>`` pass.

    Args:
        weight: Multiplier in the total reward.
        score: Value for a well-formed completion (official: 0.5).
        name: Metric name (default ``think_answer_format``).
    """

    def __init__(self, weight: float = 1.0, score: float = 0.5, name: str | None = None) -> None:
        super().__init__(weight, score, name)

    @override
    def passes(self, completion: str) -> bool:
        return _STRICT.match(completion) is not None


class TagCountReward(Reward):
    """``per_tag`` for each of ``tags`` that appears exactly once (the official ``xmlcount``: 4 x 0.025).

    Args:
        weight: Multiplier in the total reward.
        tags: Tags to count.
        per_tag: Value per tag present exactly once.
        name: Metric name (default ``tag_count``).
    """

    def __init__(
        self,
        weight: float = 1.0,
        tags: Sequence[str] = ("<think>", "</think>", "<answer>", "</answer>"),
        per_tag: float = 0.025,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        self.tags, self.per_tag = tuple(tags), per_tag

    @override
    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float]:
        return [sum(self.per_tag for tag in self.tags if c.count(tag) == 1) for c in completions]


class AnswerNumberReward(_CheckReward):
    """``score`` if the first ``<answer>...</answer>`` holds a number (the official ``int_reward_func``: 0.2).

    Args:
        weight: Multiplier in the total reward.
        score: Value when a number is present.
        name: Metric name (default ``answer_number``).
    """

    def __init__(self, weight: float = 1.0, score: float = 0.2, name: str | None = None) -> None:
        super().__init__(weight, score, name)

    @override
    def passes(self, completion: str) -> bool:
        match = _ANSWER.search(completion)
        return match is not None and _DIGIT.search(match.group(1)) is not None


class ToolUseReward(Reward):
    """``score`` for an episode that called a tool and got a result, not an error (``data.tools``).

    A shaping reward for a policy that rarely calls its tools at first: RL learns to call them only from groups in
    which some episodes did. It reads the calls each episode made (the ``tool_calls`` rewards get with
    ``ToolEnvironment``); outside such episodes it does not apply (``None``).

    Args:
        weight: Multiplier in the total reward.
        score: Value for an episode with a call that returned a result.
        attempt_score: Value for an episode whose every call failed (one that did not parse, named no tool, or got
            an error): a first rung for a policy that rarely writes a call at all (below ``score``).
        tool: Only calls of this tool count (default: any).
        name: Metric name (default ``tool_use``).
    """

    def __init__(
        self,
        weight: float = 1.0,
        score: float = 0.2,
        attempt_score: float = 0.0,
        tool: str | None = None,
        name: str | None = None,
    ):
        super().__init__(weight, name)
        if not 0 <= attempt_score <= score:
            raise ValueError(f"ToolUseReward attempt_score must be in [0, score {score}], got {attempt_score}")
        self.value, self.attempt, self.tool = score, attempt_score, tool

    @override
    def score(self, completions: Sequence, answers: Sequence[str], **kwargs) -> list[float | None]:
        calls = kwargs.get("tool_calls") or [None] * len(completions)
        return [None if made is None else self._of(made) for made in calls]

    def _of(self, made: list[dict]) -> float:
        if any(not c["error"] and self.tool in (None, c["name"]) for c in made):
            return self.value
        return self.attempt if made else 0.0
