"""The reward seam: a ``Reward`` class whose knobs are its constructor arguments, or a plain function.

Every reward sees the same inputs, TRL's reward-function keyword arguments: ``prompts``, ``completion_ids``,
``finish_reasons``, the reference ``answer`` and every column of the dataset row, by name. A plain function
``fn(completions, **kwargs) -> list[float | None]`` written for TRL's ``GRPOTrainer`` runs unchanged
(``FunctionReward``); ``None`` means "does not apply to this completion" and counts neither as 0 nor as NaN.
"""

from __future__ import annotations

import importlib
import inspect
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from amir_lightning.data.base import Prompt
from amir_lightning.validation import check_number, raise_errors

#: Dataset columns TRL does not pass to reward functions (the prompt comes as ``prompts``).
NOT_PASSED = ("prompt", "completion")


@dataclass
class RewardInputs:
    """What every reward sees of a rollout, one entry per completion (the G completions of a prompt in a row).

    Attributes:
        completions: Completion texts.
        prompts: The ``Prompt`` of each completion.
        completion_ids: Generated token ids.
        finish_reasons: ``stop`` or ``length``.
    """

    completions: list[str]
    prompts: list[Prompt]
    completion_ids: list[list[int]]
    finish_reasons: list[str]

    @property
    def answers(self) -> list[str]:
        """Reference answers (``""`` for a prompt-only dataset)."""
        return [p.answer for p in self.prompts]

    def trl_completions(self) -> list:
        """Completions as TRL passes them.

        Text, or ``[{"role": "assistant", "content": text}]`` where the prompt is conversational.
        """
        return [
            [{"role": "assistant", "content": text}] if p.messages is not None else text
            for text, p in zip(self.completions, self.prompts)
        ]

    def kwargs(self) -> dict[str, list]:
        """TRL's keyword arguments of a reward function.

        Every dataset column by name (TRL's ``prompt`` and ``completion`` excepted), ``prompts``,
        ``completion_ids``, ``finish_reasons``, and the reference ``answer`` when no column has that name.
        """
        keys = list(dict.fromkeys(key for p in self.prompts for key in p.row))
        out: dict[str, list[Any]] = {k: [p.row.get(k) for p in self.prompts] for k in keys if k not in NOT_PASSED}
        out.setdefault("answer", self.answers)
        out["prompts"] = [list(p.messages) if p.messages is not None else p.question for p in self.prompts]
        out["completion_ids"] = self.completion_ids
        out["finish_reasons"] = self.finish_reasons
        return out


class Reward(ABC):
    """Scores completions; the rollout combines rewards as a weighted sum and logs each as ``rollout/reward/<name>``.

    Subclasses implement ``score(completions, answers, **kwargs)``; the keyword arguments (``RewardInputs.kwargs``)
    are passed when ``score`` accepts them.

    Args:
        weight: Multiplier of this reward in the total.
        name: Metric name; defaults to the class name without the ``Reward`` suffix, in snake case.
    """

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

    def close(self) -> None:  # noqa: B027 (optional hook: most rewards hold nothing)
        """Release resources (worker processes)."""


class FunctionReward(Reward):
    """A plain reward function with TRL's signature: ``fn(completions, **kwargs) -> list[float | None]``.

    ``completions`` are texts, or assistant messages for a conversational dataset (as TRL passes them). The
    function runs in the trainer process: wrap it in a subprocess or a timeout yourself if it can hang or crash
    (the built-in ``MathAnswerReward`` grades in sandboxed workers).

    In YAML, a dotted path in ``data.rewards`` is shorthand for ``FunctionReward`` with weight 1::

        rewards:
          - my_rewards.length_penalty
          - class_path: amir_lightning.rewards.FunctionReward
            init_args: {function: my_rewards.uses_difficulty, weight: 0.5}

    Args:
        function: ``module.function`` (or ``module:function``); the directory ``amir`` runs from is importable.
        weight: Multiplier in the total reward.
        name: Metric name (default: the function's name).
    """

    def __init__(self, function: str, weight: float = 1.0, name: str | None = None) -> None:
        self.function = import_function(function)
        super().__init__(weight, name or self.function.__name__)

    def score(self, completions: Sequence, answers: Sequence[str], **kwargs) -> list[float | None]:  # noqa: D102
        return list(self.function(completions, **kwargs))

    def __call__(self, inputs: RewardInputs) -> list[float | None]:  # noqa: D102
        try:
            return self.score(inputs.trl_completions(), inputs.answers, **inputs.kwargs())
        except Exception as err:
            err.add_note(f"raised by the reward function {self.name} (data.rewards)")
            raise


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
