"""DAPO's soft overlong punishment: a linear penalty on completions that run into a buffer before the length cap.

A completion cut at ``max_new_tokens`` is usually wrong for lack of room, not of reasoning; scoring it as any wrong
answer adds noise, and dropping it wastes the sample. DAPO (arXiv 2503.14476, section 3.4) adds a
length-aware penalty instead: 0 up to ``L_max - L_cache`` tokens, then falling linearly to -1 at ``L_max``, and -1
beyond. Add it beside the correctness reward (``data.rewards``); ``L_max`` defaults to the run's
``data.sampling.max_new_tokens``.

In a multi-turn episode the cap is a turn's: each policy turn is sampled with ``max_new_tokens`` of its own, and a turn
that reaches it cuts the episode, whatever the turns before wrote. So an episode is scored by its longest policy turn,
the one nearest its cut; a tool's replies are context the policy did not write, and count nowhere. (An episode's whole
policy-token budget, ``max_turns`` times ``max_new_tokens``, is dr_grpo's ``L``; no episode is cut there, so a penalty
against it would miss the cut it is meant to warn of.)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.base import Reward

KEY = "data.rewards: OverlongPenalty"


def longest_turn(token_ids: Sequence[int], mask: Sequence[int] | None) -> int:
    """The most tokens the policy wrote in one turn: the longest run of 1 in ``mask`` (all of ``token_ids`` without).

    Two turns with no reply tokens between them (an environment that replied ``""``) read as one run.
    """
    if mask is None:
        return len(token_ids)
    runs = (len(list(run)) for own, run in groupby(mask[: len(token_ids)]) if own)
    return max(runs, default=0)


class OverlongPenalty(Reward):
    """``max(-1, min(0, ((L_max - L_cache) - length) / L_cache))`` per completion, logged ``rollout/reward/overlong``.

    The length is the completion's token count as generated (its end-of-sequence token included); in a multi-turn
    episode, its longest policy turn (``longest_turn``: a tool's replies and the other turns do not count).

    Args:
        buffer_tokens: ``L_cache``: the penalty grows over the last this many tokens before ``max_tokens``.
        max_tokens: ``L_max``; by default the run's ``data.sampling.max_new_tokens``, the cap of each turn. A smaller
            one penalises completions past it by the full -1; a larger one is refused (the penalty would never reach
            -1 at the cut).
        weight: Multiplier in the total reward (DAPO's penalty factor, 1).
        name: Metric name (``overlong``).
    """

    def __init__(
        self, buffer_tokens: int = 64, max_tokens: int | None = None, weight: float = 1.0, name: str | None = "overlong"
    ) -> None:
        errors: list[str] = []
        check_number(errors, f"{KEY}.buffer_tokens", buffer_tokens, ge=1)
        if max_tokens is not None:
            check_number(errors, f"{KEY}.max_tokens", max_tokens, ge=2)
        raise_errors(errors)
        super().__init__(weight, name)
        self.buffer_tokens, self.max_tokens = buffer_tokens, max_tokens
        if max_tokens is not None:
            self._check()

    def fit_to_sampling(self, max_new_tokens: int) -> None:
        """``max_tokens`` is the run's cap unless given; one given above it is refused."""
        if self.max_tokens is None:
            self.max_tokens = max_new_tokens
            self._check("data.sampling.max_new_tokens")
        elif self.max_tokens > max_new_tokens:
            raise ValueError(
                f"{KEY}.max_tokens ({self.max_tokens}) is above data.sampling.max_new_tokens ({max_new_tokens}), the "
                f"most tokens a turn can have: the penalty would never reach -1 (give at most {max_new_tokens}, or "
                "leave it unset)"
            )

    def _check(self, source: str = f"{KEY}.max_tokens") -> None:
        if self.buffer_tokens >= self.max_tokens:
            raise ValueError(
                f"{KEY}.buffer_tokens ({self.buffer_tokens}) must be below the length cap ({source} = "
                f"{self.max_tokens}): the penalty would start before the first token"
            )

    def penalty(self, length: int) -> float:
        """The penalty of a completion of ``length`` tokens, in [-1, 0]."""
        start = self.max_tokens - self.buffer_tokens
        return max(-1.0, min(0.0, (start - length) / self.buffer_tokens))

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """The penalty of each completion by its longest policy turn (``completion_ids``, ``completion_mask``)."""
        ids = kwargs.get("completion_ids")
        if ids is None or len(ids) != len(completions):
            raise ValueError("OverlongPenalty needs the completions' token ids (completion_ids)")
        if self.max_tokens is None:
            raise ValueError(f"{KEY}.max_tokens is not set: give it, or let the run set it from data.sampling")
        masks = kwargs.get("completion_mask") or [None] * len(ids)
        return [self.penalty(longest_turn(tokens, mask)) for tokens, mask in zip(ids, masks)]
