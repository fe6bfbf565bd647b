"""A turn's tool calls, run together: each on a thread of its own, all under one deadline, the wait ended by a stop.

The calls of every episode's turn start at once, and the turn waits ``timeout_s`` for all of them, not ``timeout_s``
for each in turn (16 episodes calling a tool that hangs held one turn 16 x 10 s, silently). A call still running at
the deadline is answered with an error, one warning per tool says so, and its thread is left to finish: Python
cannot stop one (a tool that must be stopped should run its work in a process). While it waits the turn looks for a
stop (SIGTERM, Ctrl-C: ``helpers/stops.py``) every ``_STOP_CHECK_S`` seconds and ends in what the run makes of it,
as a request to a server does.

A result is cut to ``max_chars`` characters on its own thread, before the turn holds it (``reply_char_bound``: more
than the policy can read of it), so an episode never holds what a tool printed whole. What the tools could change of
the process (working directory, grad mode, default dtype, threads) is put back once the wait ends, as a reward's is;
tools that run together share the process, as concurrent rewards do.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from amir_lightning.helpers import stops
from amir_lightning.helpers.process_state import process_state, put_back

log = logging.getLogger(__name__)

#: How often a wait on tools looks for a stop (seconds): the longest a stop waits for it.
_STOP_CHECK_S = 0.1


@dataclass
class CallResult:
    """What a call gave: its result as text (cut to ``max_chars``), whether an error, and the seconds it took."""

    text: str
    error: bool
    seconds: float


def run_together(
    calls: Sequence[tuple[str, Callable, dict[str, Any]]], timeout_s: float, max_chars: int
) -> list[CallResult]:
    """``function(**arguments)`` of each ``(name, function, arguments)`` as text, all at once, within ``timeout_s``.

    A result that is not a string is its JSON; an exception (``sys.exit()`` included) is the result
    ``error: <type>: <message>``; a call not done at the deadline is the result ``error: <name> did not answer ...``.

    Raises:
        BaseException: What the run makes of a stop asked for while it waits (``stops.interruption``).
    """
    if not calls:
        return []
    before, start = process_state(), time.monotonic()
    outcomes: list[list[CallResult]] = [[] for _ in calls]
    threads = [
        threading.Thread(target=_call, args=(function, arguments, max_chars, outcome), name=f"tool-{name}", daemon=True)
        for (name, function, arguments), outcome in zip(calls, outcomes)
    ]
    try:
        for thread in threads:
            thread.start()
        _wait(threads, start + timeout_s)
    finally:
        put_back(before, _who({name for name, _, _ in calls}))
    seconds = time.monotonic() - start
    late = [name for (name, _, _), outcome in zip(calls, outcomes) if not outcome]
    _say_late(late, Counter(name for name, _, _ in calls), timeout_s)
    return [
        outcome[0] if outcome else CallResult(f"error: {name} did not answer within {timeout_s:g} s", True, seconds)
        for (name, _, _), outcome in zip(calls, outcomes)
    ]


def _call(function: Callable, arguments: dict[str, Any], max_chars: int, outcome: list[CallResult]) -> None:
    """One call, on its thread: its result as text, cut to ``max_chars`` before anything holds it."""
    start = time.monotonic()
    try:
        value = function(**arguments)
        text, error = (value if isinstance(value, str) else json.dumps(value, default=str)), False
    except BaseException as err:  # noqa: BLE001 - sys.exit() in a tool is the tool's error, not the run's end
        text, error = f"error: {type(err).__name__}: {err}", True
    outcome.append(CallResult(text[:max_chars], error, time.monotonic() - start))


def _wait(threads: Sequence[threading.Thread], deadline: float) -> None:
    """Until every thread is done or ``deadline`` (``time.monotonic``) passes, looking for a stop in between."""
    for thread in threads:
        while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            thread.join(min(left, _STOP_CHECK_S))
            stops.raise_if_stopped()


def _who(names: set[str]) -> str:
    """The tools of a turn as the warning about a changed process state names them."""
    return f"tool {next(iter(names))}" if len(names) == 1 else f"one of the tools {', '.join(sorted(names))}"


def _say_late(late: list[str], called: Counter, timeout_s: float) -> None:
    """One warning per tool with calls still running at the deadline."""
    for name, count in Counter(late).items():
        log.warning(
            "data.tools: tool %s did not answer within %g s (timeout_s) in %d of %d calls; the policy reads an error, "
            "and their threads are left to finish",
            name,
            timeout_s,
            count,
            called[name],
        )
