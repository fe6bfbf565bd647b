"""A new environment in one file, through the environment seam alone: each turn that ends at a digit is answered
``=<the digit doubled>``, for at most three turns.

``tests/test_rooms.py`` trains with it (``--data.environment helpers.toy_environment.Doubler``): adding an
environment touches no file of the package.
"""

from __future__ import annotations

from amir_lightning.environments import Environment


class Doubler(Environment):
    """Replies ``=2d`` to a turn that ends at the digit ``d``; a turn that ends otherwise ends the episode."""

    def __init__(self) -> None:
        super().__init__(max_turns=3, stop=list("0123456789"), max_reply_tokens=4)

    def reset(self, prompt):  # noqa: D102
        return 0

    def step(self, state, message):  # noqa: D102
        return f"={2 * int(message[-1])}" if message[-1:].isdigit() else None
