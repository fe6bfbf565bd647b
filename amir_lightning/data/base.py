"""The prompt-source seam: an indexable collection of (question, reference answer) items."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation problem.

    Attributes:
        question: The user message (of a conversational prompt: its last user message).
        answer: The reference answer as the dataset gives it (e.g. GSM8K's ``... #### 72``); ``""`` when the
            dataset has none (prompt-only: the rewards judge the completion alone).
        meta: Where it came from (file and line, dataset index, generator parameters) for error messages and logs.
        messages: A conversational prompt (TRL's format): ``{"role", "content"}`` messages, rendered as they are;
            a system message among them replaces ``data.system_prompt``. ``None``: ``question`` is the user message.
        columns: Every column of the dataset row, passed by name to reward functions.
    """

    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] | None = None
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def row(self) -> dict[str, Any]:
        """The dataset row the rewards see: its columns, or ``question`` and ``answer`` for generated problems."""
        return self.columns or {"question": self.question, "answer": self.answer}


class PromptSource(ABC):
    """An indexable collection of prompts (procedural generators give each index a fresh random problem).

    Attributes:
        is_random: Consecutive indices are already independent random draws, so the stream need not shuffle.
    """

    is_random: bool = False

    @abstractmethod
    def __len__(self) -> int:
        """Number of prompts (the nominal index space for procedural generators)."""

    @abstractmethod
    def __getitem__(self, index: int) -> Prompt:
        """The prompt at ``index`` (deterministic: the same index always gives the same prompt)."""

    def describe(self) -> str:
        """One line naming the source, for logs and errors."""
        return type(self).__name__


class PromptList(PromptSource):
    """A prompt source read into a list once (``items``); an index past its end wraps around."""

    items: list[Prompt]

    @override
    def __len__(self) -> int:
        return len(self.items)

    @override
    def __getitem__(self, index: int) -> Prompt:
        return self.items[index % len(self.items)]
