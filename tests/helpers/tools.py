"""Environments of the multi-turn tests, importable by ``amir`` (the tests put this folder on PYTHONPATH)."""

from amir_lightning.environments.base import Environment


class AnswerTool(Environment):
    """A tool the policy calls by writing ``?``: it replies with the problem's answer (an oracle a tiny model can
    learn to use: it cannot add, but it can ask and stop)."""

    def __init__(self, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns, stop=["?"], max_reply_tokens=4)

    def reset(self, prompt):  # noqa: D102
        return prompt.answer

    def step(self, state, message):  # noqa: D102
        return state if message.endswith("?") else None


class Echo(Environment):
    """Every turn ends at its first digit, and the reply is ``=12`` until the turn limit: episodes with a reply
    between every two turns (unless the policy stops or runs out of tokens first)."""

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__(max_turns=max_turns, stop=list("0123456789"), max_reply_tokens=8)

    def reset(self, prompt):  # noqa: D102
        return None

    def step(self, state, message):  # noqa: D102
        return "=12"


class BuggyStep(Echo):
    """``step`` has a bug: it raises ``TypeError`` (``len`` of the state, which is ``None``)."""

    def __init__(self, max_turns: int = 3, on_step_error: str = "stop") -> None:
        super().__init__(max_turns=max_turns)
        self.on_step_error = on_step_error  # set here, not through Environment's argument, so main's code builds it

    def step(self, state, message):  # noqa: D102
        return "=" + str(len(state))


class BuggyReset(Echo):
    """``reset`` raises ``KeyError`` (a prompt field that is not there)."""

    def reset(self, prompt):  # noqa: D102
        return prompt.meta["difficulty"]


class NumberReply(Echo):
    """``step`` returns the number 12, not the text ``"12"``."""

    def step(self, state, message):  # noqa: D102
        return 12


class MegabyteReply(Echo):
    """Replies with a megabyte, ``=1=1...``, every turn (a tool that prints a whole file)."""

    def step(self, state, message):  # noqa: D102
        return "=1" * 500_000


class PageReply(Echo):
    """Replies with what ``MegabyteReply``'s reply is cut to (its first ``max_reply_tokens`` = 8 characters)."""

    def step(self, state, message):  # noqa: D102
        return "=1=1=1=1"


class GarbledReply(Echo):
    """Replies with text holding a lone surrogate (bytes decoded with ``surrogateescape``), which no tokenizer reads."""

    def __init__(self, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)
        self.max_reply_tokens = 80

    def step(self, state, message):  # noqa: D102
        return "=1\ud800"
