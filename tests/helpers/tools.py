"""Environments of the multi-turn tests, importable by ``amir`` (the tests put this folder on PYTHONPATH)."""

from amir_lightning.rollout.episodes import Environment


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
