"""The reward seam: a ``Reward`` class whose knobs are its constructor arguments, or a plain function.

Every reward sees the same inputs, TRL's reward-function keyword arguments (``rewards/inputs.py``). A plain function
``fn(completions, **kwargs) -> list[float | None]`` written for TRL's ``GRPOTrainer`` runs unchanged
(``FunctionReward``); ``None`` means "does not apply to this completion" and counts neither as 0 nor as NaN.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from typing_extensions import override

from amir_lightning.helpers import stops
from amir_lightning.helpers.http import ServerError
from amir_lightning.helpers.process_state import process_state, put_back
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.inputs import RewardInputs

log = logging.getLogger(__name__)


class Reward(ABC):
    """Scores completions; the rollout combines rewards as a weighted sum and logs each as ``rollout/reward/<name>``.

    Subclasses implement ``score(completions, answers, **kwargs)``; the keyword arguments (``RewardInputs.kwargs``)
    are passed when ``score`` accepts them.

    Args:
        weight: Multiplier of this reward in the total.
        name: Metric name; defaults to the class name without the ``Reward`` suffix, in snake case.
    """

    #: Whether the reward grades against the reference answer (a training set without one is refused at start).
    needs_reference: bool = False
    #: Whether the reward waits on something else (a server, an ``async def`` function): it is then scored on a
    #: thread of its own, alongside the other rewards, and must not change the process's state.
    concurrent: bool = False

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        errors: list[str] = []
        check_number(errors, f"data.rewards: {type(self).__name__}.weight", weight)
        raise_errors(errors)
        self.weight = float(weight)
        self.name = name or _snake(type(self).__name__.removesuffix("Reward"))

    @abstractmethod
    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float | None]:
        """One value per completion (``None``: does not apply); ``answers[i]`` is completion ``i``'s reference."""

    def __call__(self, inputs: RewardInputs) -> list[float | None]:
        """Score a rollout's completions."""
        accepts = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(self.score).parameters.values())
        extra = inputs.kwargs() if accepts else {}
        return self.score(inputs.completions, inputs.answers, **extra)

    def metrics(self) -> dict[str, float]:
        """Numbers about the last ``score`` call, logged each rollout as ``<name>/<key>`` (the judge's unparsed share).

        Optional: most rewards have none. Every process must return the same keys (they are averaged over processes).
        """
        return {}

    def fit_to_sampling(self, max_new_tokens: int) -> None:  # noqa: B027 (optional hook: most rewards need nothing)
        """Learn the rollout's completion cap (``data.sampling.max_new_tokens``) before the first rollout."""

    def setup(self) -> None:  # noqa: B027 (optional hook: most rewards hold nothing)
        """Start what the reward needs (a server), before the first rollout; every training process calls it."""

    def close(self) -> None:  # noqa: B027 (optional hook: most rewards hold nothing)
        """Release resources (worker processes)."""


class FunctionReward(Reward):
    """A plain reward function with TRL's signature: ``fn(completions, **kwargs) -> list[float | None]``.

    ``completions`` are texts, or assistant messages for a conversational dataset (as TRL passes them). The
    function runs in the trainer process: wrap it in a subprocess or a timeout yourself if it can hang or crash
    (the built-in ``MathAnswerReward`` grades in sandboxed workers). An ``async def`` function (one that awaits a
    remote service) runs in an event loop of its own, concurrently with the other rewards.

    In YAML, a dotted path in ``data.rewards`` is shorthand for ``FunctionReward`` with weight 1::

        rewards:
          - my_rewards.length_penalty
          - class_path: amir_lightning.rewards.FunctionReward
            init_args: {function: my_rewards.uses_difficulty, weight: 0.5}

    Args:
        function: ``module.function`` (or ``module:function``); the directory ``amir`` runs from is importable.
        weight: Multiplier in the total reward.
        name: Metric name (default: the function's name).
        timeout_s: Stop the run when one call takes longer, naming the function. The function then runs in a
            thread of its own, where ``signal``-based timeouts inside it (``signal.alarm``) do not work.
    """

    def __init__(
        self, function: str, weight: float = 1.0, name: str | None = None, timeout_s: float | None = None
    ) -> None:
        self.function = import_function(function)
        super().__init__(weight, name or self.function.__name__)
        errors: list[str] = []
        check_number(errors, f"data.rewards: {self.name}.timeout_s", timeout_s, gt=0, optional=True)
        raise_errors(errors)
        self.timeout_s = timeout_s
        self.concurrent = inspect.iscoroutinefunction(self.function)

    @override
    def score(self, completions: Sequence, answers: Sequence, **kwargs) -> list[float | None]:
        if self.concurrent:
            return asyncio.run(self.function(completions, **kwargs))
        return self.function(completions, **kwargs)

    @override
    def __call__(self, inputs: RewardInputs) -> list[float | None]:
        def call():
            return self.score(inputs.trl_completions(), inputs.answers, **inputs.kwargs())

        return call() if self.timeout_s is None else _with_timeout(call, self.timeout_s, self.name)


class RewardError(RuntimeError):
    """A reward raised or ran over its time.

    The message names the reward and, for an exception, the line of its code that raised; ``__cause__`` holds the
    exception.
    """


def call_reward(reward: Reward, inputs: RewardInputs, warn_s: float = 60.0) -> list:
    """``reward(inputs)``, isolated from the trainer's state.

    The reward gets a copy of the inputs (one that edits them in place changes nothing the trainer trains on); the
    process state it could change (working directory, grad mode, default dtype, threads) is restored after the call
    and the change reported once (not for a ``concurrent`` reward, which runs beside others); an exception becomes a
    ``RewardError`` naming the reward and its file and line; a call is reported every ``warn_s`` seconds while it
    runs (``data.rollout.reward_warn_s``).
    """
    state = None if reward.concurrent else process_state()
    try:
        with _heartbeat(reward.name, warn_s):
            return reward(inputs.copy(reward.name))
    except (RewardError, ServerError):  # a judge's server: named as such
        raise
    except (Exception, SystemExit) as err:  # sys.exit() in a reward would end the run as if it had finished
        if stops.is_stop(err):  # a preemption, not the reward's error
            raise
        raise RewardError(f"reward {reward.name} ({raised_at(err)}) raised {type(err).__name__}: {err}") from err
    finally:
        if state is not None:
            put_back(state, f"reward {reward.name}")


@contextmanager
def _heartbeat(name: str, every_s: float) -> Iterator[None]:
    """Warn every ``every_s`` seconds while the reward ``name`` runs (a reward that hangs is not silent)."""
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not done.wait(every_s):
            log.warning("reward %s has been running for %.0f s", name, time.monotonic() - started)

    watcher = threading.Thread(target=watch, name=f"reward-{name}-heartbeat", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _with_timeout(call: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """``call()`` in a daemon thread; a ``RewardError`` when it runs longer than ``timeout_s``."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = err

    worker = threading.Thread(target=run, name=f"reward-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError(f"reward {name} ran longer than its timeout_s ({timeout_s:g} s) (data.rewards)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def raised_at(err: BaseException) -> str:
    """``file:line`` of the innermost frame outside this package (the reward's own code), else the innermost."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "?"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(package + os.sep)]
    frame = (outside or frames)[-1]
    return code_at(frame.filename, frame.lineno)


def code_at(filename: str, line: int | None) -> str:
    """``file:line``, the file relative to the working directory where it lies under it."""
    path = os.path.abspath(filename)
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{shown}:{line}"


def import_function(path: str) -> Callable:
    """The callable at ``module.function`` or ``module:function``; an error names the path and what failed."""
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"data.rewards: {path!r} is not a dotted path to a function (module.function)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"data.rewards: cannot import {module_name!r} for the reward function {path!r}: {err} (importable: "
            f"installed packages and the directory amir runs from, {os.getcwd()})"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"data.rewards: {module_name} has no function {attribute!r} (reward function {path!r})")
    return function


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out) or "reward"
