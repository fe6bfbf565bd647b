"""Dynamic sampling: sample more prompts until a rollout has its groups with reward variance.

A group whose G rewards are all equal has zero advantage everywhere: no policy gradient and, for AMIR-GRPO, no pairs
(arXiv 2601.03661 mines its pairs from the reward ranking inside a group). Dropping such groups
(``data.rollout.drop_zero_std_groups``) shrinks the step as the task becomes easy or hard; DAPO's dynamic sampling
(arXiv 2503.14476, section 3.2) samples more prompts instead, until the batch is full again. ``refill`` does that
for one process: after the rollout's first round, further rounds of prompts drawn from the stream, sampled and
scored, until ``prompts_per_process`` groups have variance or ``max_sampling_rounds`` rounds ran.

In turn (``max_staleness`` 0) the further rounds take the stream's next prompts and sample them from the first
round's weights. A rollout sampled ahead is refilled when an epoch takes it: its further rounds sample from the
weights that epoch trains, pushed first, and draw from the refill stream (``data/feed.py``), as the stream's next
prompts belong to the rollouts sampling ahead. Their tokens are then not stale; ``rollout/staleness_steps`` counts them.

Every process runs the same rounds and draws the same number of prompts in each (the stream stays in step; a
process already full draws its share without sampling it), so the steps that follow are planned as before
(``agree_on_plan``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.helpers import stops
from amir_lightning.loop.rewarding import Scores

log = logging.getLogger(__name__)
#: Seconds between the lines that say where a long refill stands.
PROGRESS_S = 30.0


@dataclass
class Round:
    """One round of a rollout's sampling, built scored.

    Attributes:
        prompts: Its prompts.
        prompt_ids: Their token ids.
        completions: ``G`` per prompt.
        scores: Their scores (``[count * G]`` totals).
        generate_s: Seconds sampling took.
    """

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[Completion]]
    scores: Scores
    generate_s: float


def has_variance(scores: Scores, group_size: int) -> list[bool]:
    """Per group: finite rewards that are not all equal (the groups a step learns from)."""
    rows = scores.total.view(-1, group_size)
    return [bool(torch.isfinite(row).all() and (row != row[0]).any()) for row in rows]


def prompts_to_draw(wanted: int, kept: int, sampled: int) -> int:
    """How many prompts the next round draws: 0 when full, else at most ``wanted``.

    Enough to find the ``wanted - kept`` missing groups at the share with variance seen so far (``kept`` of
    ``sampled``); ``wanted`` when none had variance yet.
    """
    missing = wanted - kept
    if missing <= 0:
        return 0
    if kept == 0:
        return wanted
    return min(wanted, math.ceil(missing * sampled / kept))


def needs_more(first: Round, wanted: int, group_size: int, max_rounds: int, max_over_processes) -> bool:
    """Whether a further round will sample on some process: a group of ``first`` without variance anywhere.

    Every process calls it (one collective), with the arguments of ``refill``.
    """
    missing = wanted - sum(has_variance(first.scores, group_size))
    return max_rounds > 1 and max_over_processes([float(missing)])[0] > 0


class Refill:
    """Dynamic sampling for one rollout: further rounds until it has its groups with reward variance.

    From its ``first`` round, until it has ``wanted`` groups with reward variance or ``max_rounds`` ran out. The loop
    drives it::

        while count := refill.next_draw():            # every process, the same count (one collective)
            prompts = draw(count)                      # every process draws alike
            refill.add(sample(prompts) if refill.missing else None)
        kept, metrics = refill.result()

    Args:
        first: The rollout's first round (``wanted`` prompts), scored.
        wanted: ``prompts_per_process``.
        group_size: ``G``.
        max_rounds: ``max_sampling_rounds``, the first included.
        max_over_processes: Every process calls it once per round: the largest draw any process needs.
    """

    def __init__(
        self,
        first: Round,
        wanted: int,
        group_size: int,
        max_rounds: int,
        max_over_processes: Callable[[list[float]], list[float]],
    ) -> None:
        self.wanted, self.group_size, self.max_rounds = wanted, group_size, max_rounds
        self.max_over_processes = max_over_processes
        self.rounds, self.flags = [first], [has_variance(first.scores, group_size)]
        self.index, self._said = 1, time.monotonic()  # the next round's index

    @property
    def missing(self) -> bool:
        """Whether this process still lacks groups with variance (a full process skips its share of a draw)."""
        return sum(map(sum, self.flags)) < self.wanted

    def next_draw(self) -> int:
        """How many prompts round ``index`` draws, the same on every process; 0: full everywhere, or no rounds left.

        A stop asked for (SIGTERM, Ctrl-C) ends the refill here, and a line every ``PROGRESS_S`` says where a long
        one stands.
        """
        if self.index >= self.max_rounds:
            return 0
        stops.raise_if_stopped()
        kept, sampled = sum(map(sum, self.flags)), sum(map(len, self.flags))
        if time.monotonic() - self._said >= PROGRESS_S:
            self._said = time.monotonic()
            log.info("dynamic sampling: round %d of at most %d (data.rollout.max_sampling_rounds): %d of %d groups "
                     "with reward variance, in %d sampled", self.index + 1, self.max_rounds, kept, self.wanted,
                     sampled)  # fmt: skip
        return int(self.max_over_processes([float(prompts_to_draw(self.wanted, kept, sampled))])[0])

    def add(self, extra: Round | None) -> None:
        """Round ``index``, scored (``None``: this process was full and sampled nothing)."""
        self.index += 1
        if extra is not None:
            self.rounds.append(extra)
            self.flags.append(has_variance(extra.scores, self.group_size))

    def result(self) -> tuple[Round, dict[str, float]]:
        """The rollout's ``wanted`` groups as one round, and dynamic sampling's metrics.

        The groups with variance in the order sampled, then, when the rounds ran out, groups without (which the step
        drops: kept so that every process has a rollout to log and a filler to plan with). The metrics:
        ``rollout/sampling_rounds``, ``rollout/kept_group_frac`` (groups with variance among those sampled),
        ``rollout/zero_std_frac`` (all rewards equal, among those sampled).
        """
        rounds, flags, size = self.rounds, self.flags, self.group_size
        places = [(r, g) for r, round_flags in enumerate(flags) for g, varied in enumerate(round_flags) if varied]
        places = places[: self.wanted]
        fill = [(r, g) for r, round_flags in enumerate(flags) for g, varied in enumerate(round_flags) if not varied]
        places += fill[: self.wanted - len(places)]
        sampled = sum(map(len, flags))
        zero_std = sum(bool((row == row[0]).all()) for r in rounds for row in r.scores.total.view(-1, size))
        metrics = {
            "rollout/sampling_rounds": float(self.index),
            "rollout/kept_group_frac": sum(map(sum, flags)) / sampled,
            "rollout/zero_std_frac": zero_std / sampled,
        }
        return _select(rounds, places, size), metrics


def _select(rounds: list[Round], places: list[tuple[int, int]], group_size: int) -> Round:
    """The groups at ``places`` (round, group) as one round.

    Its reward and length metrics are the first round's (a uniform draw of prompts, not one chosen by its rewards);
    its seconds are every round's.
    """

    def rows(tensor_of, r: int, g: int) -> torch.Tensor:
        return tensor_of(rounds[r].scores)[g * group_size : (g + 1) * group_size]

    def cells(column: str, r: int, g: int) -> list:  # a column a round's rewards did not log: None
        values = rounds[r].scores.extra.get(column)
        return values[g * group_size : (g + 1) * group_size] if values is not None else [None] * group_size

    columns = list(dict.fromkeys(name for r in rounds for name in r.scores.extra))
    scores = Scores(
        torch.cat([rows(lambda s: s.total, r, g) for r, g in places]),
        dict(rounds[0].scores.metrics),
        torch.cat([rows(lambda s: s.correct, r, g) for r, g in places]),
        sum(r.scores.seconds for r in rounds),
        {name: [cell for r, g in places for cell in cells(name, r, g)] for name in columns},
    )
    return Round(
        [rounds[r].prompts[g] for r, g in places],
        [rounds[r].prompt_ids[g] for r, g in places],
        [rounds[r].completions[g] for r, g in places],
        scores,
        sum(r.generate_s for r in rounds),
    )
