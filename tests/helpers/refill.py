"""Dynamic sampling driven as the loop drives it (``loop/schedule.py``'s ``_refill``), with a scripted ``more``.

``refill(first, more, ...)``: ``more(count, index, sample)`` gives round ``index``'s scored round (``None``: this
process was full), so a test scripts the rounds a rollout's refill meets.
"""

from amir_lightning.loop.dynamic import Refill


def refill(first, more, wanted, group_size, max_rounds, max_over_processes):
    """The rollout ``Refill`` keeps from ``first`` and the rounds ``more`` gives, and its metrics."""
    rounds = Refill(first, wanted, group_size, max_rounds, max_over_processes)
    while count := rounds.next_draw():
        rounds.add(more(count, rounds.index, rounds.missing))
    return rounds.result()
