"""A verifiers taskset's rewards and metrics, each call watched (``VerifiersEnvironment``, ``environment.py``).

verifiers scores an episode's trace with its task's ``@vf.reward`` and ``@vf.metric`` functions (``Task.hooks``),
on its event loop, and keeps a failure as text on the trace. ``Scoring`` hands verifiers, for each episode, a copy of
the episode's task whose functions it calls through a watch, so that, as for the run's own rewards
(``rewards/base.py``):

- a call that raises, or returns what verifiers cannot read as a score (``None``, text), becomes a ``RewardError``
  naming the function, its file and line, and the taskset; the exception is its ``__cause__``, with its traceback;
- a call still running is named every ``warn_s`` seconds (``say_running``, from the thread that waits on the
  episodes);
- a call verifiers' own scoring deadline cut (``agent.timeout.scoring``) is named, not scored as 0.

verifiers still calls the functions, records what they return and fails the episode as it would.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from amir_lightning.rewards.base import RewardError, code_at, raised_at

log = logging.getLogger(__name__)

#: The task's functions ``Task.hooks`` returns that score a trace: user code, watched.
KINDS = ("reward", "metric")


@dataclass
class Call:
    """A call of one of the task's scoring functions, in progress."""

    kind: str  # reward or metric
    name: str
    episode: int
    started: float


class Scoring:
    """One rollout's calls of a taskset's rewards and metrics: those running, and what each episode's calls did wrong.

    Args:
        taskset: The taskset's id, named in every message.
    """

    def __init__(self, taskset: str) -> None:
        self.taskset = taskset
        self.running: dict[int, Call] = {}  # written on verifiers' event loop, read by the waiting thread
        self.errors: dict[int, RewardError] = {}  # the first of each episode
        self.cut: dict[int, list[Call]] = {}  # the calls verifiers' scoring deadline cancelled, by episode
        self.tasks: dict[int, str] = {}  # each episode's task, as messages show it
        self._said: dict[tuple[str, str], float] = {}  # when a function still running was last named
        self._ids = itertools.count()

    def task(self, task: Any, episode: int) -> Any:
        """A copy of ``task`` whose rewards and metrics verifiers calls through ``watch``, for episode ``episode``.

        verifiers takes the functions that score a trace from ``task.hooks`` (0.4, pinned); the copy's are the
        task's own, each wrapped.
        """
        hooks = task.hooks
        watched = copy.copy(task)
        self.tasks[episode] = f"{task.data.prompt_text!r:.60}"

        def watched_hooks(attr: str) -> list[Callable[..., Any]]:
            functions = hooks(attr)
            return [self.watch(fn, attr, episode) for fn in functions] if attr in KINDS else functions

        watched.hooks = watched_hooks
        return watched

    def watch(self, fn: Callable[..., Any], kind: str, episode: int) -> Callable[..., Any]:
        """``fn`` (a ``kind`` of the task) as verifiers calls it, its call recorded while it runs and checked after."""

        @functools.wraps(fn)  # verifiers reads the signature, the name and the weight
        async def watched(*args, **kwargs):
            call = next(self._ids)
            self.running[call] = Call(kind, fn.__name__, episode, time.monotonic())
            try:
                value = fn(*args, **kwargs)
                if inspect.isawaitable(value):
                    value = await value
            except (Exception, SystemExit) as err:  # sys.exit() would stop verifiers' event loop
                # verifiers records it on the trace and fails the episode; the exception's traceback stays its own
                raise self._fail(episode, f"raised {type(err).__name__}: {err}", fn, kind, raised_at(err)) from err
            except asyncio.CancelledError:  # verifiers' scoring deadline, or the rollout given up
                self.cut.setdefault(episode, []).append(self.running[call])
                raise
            finally:
                self.running.pop(call, None)
            if junk := _not_scores(value):
                raise self._fail(episode, f"returned {junk[0]!r:.60}: expected a number", fn, kind, _defined_at(fn))
            return value

        return watched

    def _fail(self, episode: int, what: str, fn, kind: str, where: str) -> RewardError:
        name, task = f"{kind} {fn.__name__}", self.tasks[episode]
        error = RewardError(f"{name} of the verifiers taskset {self.taskset!r} ({where}) {what} (task {task})")
        self.errors.setdefault(episode, error)
        return error

    def say_running(self, warn_s: float, key: str) -> bool:
        """Name each function that has run ``warn_s`` seconds or more, every ``warn_s`` seconds; whether any runs."""
        now = time.monotonic()
        oldest: dict[tuple[str, str], list[Call]] = {}
        for call in list(self.running.values()):
            oldest.setdefault((call.kind, call.name), []).append(call)
        for (kind, name), calls in oldest.items():
            running_s = now - min(call.started for call in calls)
            if running_s >= warn_s and now - self._said.get((kind, name), -float("inf")) >= warn_s:
                self._said[kind, name] = now
                episodes = len({call.episode for call in calls})
                log.warning("%s %s of the verifiers taskset %r has been running for %.0f s (in %d episode%s; %s)",
                            kind, name, self.taskset, running_s, episodes, "s" * (episodes > 1), key)  # fmt: skip
        return bool(oldest)

    def cut_error(self, episode: int) -> RewardError:
        """The error of episode ``episode``, whose scoring verifiers' deadline ended (it has no score)."""
        names = sorted({f"{call.kind} {call.name}" for call in self.cut.get(episode, [])}) or ["the scoring"]
        return RewardError(
            f"{' and '.join(names)} of the verifiers taskset {self.taskset!r} ran longer than verifiers' scoring "
            f"deadline (agent.timeout.scoring, or the task's timeout.scoring) on task {self.tasks[episode]}"
        )


def _not_scores(value: Any) -> list[Any]:
    """What in ``value`` verifiers cannot record as a score (``float()`` of it, or of each value of a mapping)."""
    bad = []
    for item in value.values() if isinstance(value, Mapping) else [value]:
        try:
            float(item)
        except (TypeError, ValueError):
            bad.append(item)
    return bad


def _defined_at(fn: Callable[..., Any]) -> str:
    """``file:line`` where ``fn`` is defined."""
    function = inspect.unwrap(getattr(fn, "__func__", fn))
    code = getattr(function, "__code__", None)
    return "?" if code is None else code_at(code.co_filename, code.co_firstlineno)
