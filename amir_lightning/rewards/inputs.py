"""What every reward sees of a rollout: TRL's reward-function keyword arguments.

``prompts``, ``completion_ids``, ``finish_reasons``, the reference ``answer``, every column of the dataset row by
name, ``trainer_state`` (where the run stood, ``RunState``), and ``log_metric`` / ``log_extra`` (``RewardLog``);
in multi-turn episodes, which of their tokens are the policy's (``completion_mask``), and in episodes of tool calls,
each episode as messages and the calls it made.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from amir_lightning.data.base import Prompt

#: Dataset columns TRL does not pass to reward functions (the prompt comes as ``prompts``).
NOT_PASSED = ("prompt", "completion")


@dataclass(frozen=True)
class RunState:
    """Where the run stood when a rollout's sampling started: TRL's ``trainer_state``, as reward functions read it.

    Fixed when the rollout is drawn, so a rollout scored later (sampled ahead, or at a checkpoint) gets the same
    state, and a resumed run the same rewards.

    Attributes:
        global_step: Optimisation steps done by the weights that sampled the rollout.
        epoch: Passes over the prompt set before its prompts were drawn (TRL's fractional epoch).
        rollout: The rollout (Lightning epoch) in which its sampling started; ahead, that is before the one that
            trains it (``data.rollout.max_staleness``).
        max_steps: Optimisation steps the run is set to take (``trainer.max_steps``, else ``trainer.max_epochs``
            times ``data.rollout.steps_per_rollout``; -1 when unbounded), for rewards that follow a curriculum.
    """

    global_step: int = 0
    epoch: float = 0.0
    rollout: int = 0
    max_steps: int = -1


class RewardLog:
    """What reward functions log while one rollout is scored (TRL's ``log_metric`` and ``log_extra``).

    ``log_metric(name, value)``: a number, averaged over the rollout's calls and over processes, logged as
    ``reward/<name>``. ``log_extra(column, values)``: one value per completion, shown as a column of the rollout's
    sample table (``callbacks.RolloutSampleLogger``); values other than text, numbers, booleans and ``None`` are
    shown as their ``str``.

    Args:
        count: Completions scored (the length every ``log_extra`` column must have).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.values: dict[str, list[float]] = defaultdict(list)
        self.columns: dict[str, list] = {}
        self._lock = threading.Lock()  # ``concurrent`` rewards log from threads of their own

    def for_reward(self, name: str) -> tuple[Callable[[str, float], None], Callable[[str, Sequence], None]]:
        """``log_metric`` and ``log_extra`` for the reward ``name`` (its errors name it)."""

        def log_metric(metric: str, value: float) -> None:
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"reward {name}: log_metric({metric!r}, {value!r:.40}) needs a number") from None
            with self._lock:
                self.values[str(metric)].append(number)

        def log_extra(column: str, values: Sequence) -> None:
            if isinstance(values, str | bytes) or not hasattr(values, "__len__") or len(values) != self.count:
                got = f"{len(values)} values" if hasattr(values, "__len__") else repr(values)[:40]
                raise ValueError(
                    f"reward {name}: log_extra({column!r}, ...) got {got}; it takes one value per completion "
                    f"({self.count})"
                )
            with self._lock:
                self.columns[str(column)] = [_cell(v) for v in values]

        return log_metric, log_extra

    def metrics(self) -> dict[str, float]:
        """``reward/<name>``: the mean of what ``log_metric`` was given under ``name``."""
        return {f"reward/{k}": sum(v) / len(v) for k, v in self.values.items() if v}


def _cell(value: Any) -> Any:
    """A ``log_extra`` value as a checkpoint and a table keep it: text, a number, a boolean or ``None``."""
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


@dataclass
class RewardInputs:
    """What every reward sees of a rollout, one entry per completion (the G completions of a prompt in a row).

    Attributes:
        completions: Completion texts.
        prompts: The ``Prompt`` of each completion.
        completion_ids: Generated token ids.
        finish_reasons: ``stop`` or ``length``.
        conversations: Per completion, the episode as chat messages with its tool calls and ``tool`` turns
            (``ToolEnvironment``), else ``None``.
        tool_calls: Per completion, the calls it made (``name``, ``arguments``, ``result``, ``error``, ``seconds``),
            else ``None``.
        outcomes: Per completion, its environment's own scoring (``Episode.outcome``: ``reward``, ``rewards``,
            ``metrics``), passed as ``environment_scores``; ``None`` where the environment scores nothing.
        completion_mask: Per completion, 1 on each token the policy wrote, 0 on its environment's replies
            (``Completion.loss_mask``: a multi-turn episode's turns are the runs of 1); ``None`` for a completion
            that is the policy's alone, and for the whole rollout where none has replies.
        state: Where the run stood when the rollout's sampling started (``trainer_state``).
        log: Where ``log_metric`` and ``log_extra`` write.
        caller: The reward these inputs are given to (``copy``), named by what it logs.
    """

    completions: list[str]
    prompts: list[Prompt]
    completion_ids: list[list[int]]
    finish_reasons: list[str]
    conversations: list[list[dict[str, Any]] | None] | None = None
    tool_calls: list[list[dict[str, Any]] | None] | None = None
    outcomes: list[dict[str, Any] | None] | None = None
    state: RunState = field(default_factory=RunState)
    log: RewardLog | None = None
    caller: str = "reward"
    completion_mask: list[list[int] | None] | None = None

    @property
    def answers(self) -> list[str]:
        """Reference answers (``""`` for a prompt-only dataset)."""
        return [p.answer for p in self.prompts]

    def trl_completions(self) -> list:
        """Completions as TRL passes them.

        Text, or ``[{"role": "assistant", "content": text}]`` where the prompt is conversational; an episode of
        tool calls is its messages, the assistant's ``tool_calls`` and the ``tool`` turns included.
        """
        conversations = self.conversations or [None] * len(self.completions)
        return [
            conversation
            if conversation is not None
            else ([{"role": "assistant", "content": text}] if p.messages is not None else text)
            for text, p, conversation in zip(self.completions, self.prompts, conversations)
        ]

    def copy(self, caller: str = "reward") -> RewardInputs:
        """A deep copy for the reward ``caller``.

        What the reward edits in place never reaches the rollout the trainer trains on; what it logs goes to the
        same ``RewardLog``.
        """
        return RewardInputs(
            list(self.completions),
            copy.deepcopy(self.prompts),
            [list(ids) for ids in self.completion_ids],
            list(self.finish_reasons),
            copy.deepcopy(self.conversations),
            copy.deepcopy(self.tool_calls),
            copy.deepcopy(self.outcomes),
            self.state,
            self.log,
            caller,
            None if self.completion_mask is None else [m if m is None else list(m) for m in self.completion_mask],
        )

    def kwargs(self) -> dict[str, list]:
        """TRL's keyword arguments of a reward function.

        Every dataset column by name (TRL's ``prompt`` and ``completion`` excepted), ``prompts``,
        ``completion_ids``, ``finish_reasons``, the reference ``answer`` when no column has that name,
        ``trainer_state``, ``log_metric`` and ``log_extra``, ``completion_mask`` in multi-turn episodes, ``tool_calls``
        in episodes of tool calls, and ``environment_scores`` where the environment scores its episodes.
        """
        keys = list(dict.fromkeys(key for p in self.prompts for key in p.row))
        out: dict[str, list[Any]] = {k: [p.row.get(k) for p in self.prompts] for k in keys if k not in NOT_PASSED}
        out.setdefault("answer", self.answers)
        out["prompts"] = [list(p.messages) if p.messages is not None else p.question for p in self.prompts]
        out["completion_ids"] = self.completion_ids
        out["finish_reasons"] = self.finish_reasons
        out["trainer_state"] = self.state
        log = self.log or RewardLog(len(self.completions))  # called outside a rollout: logged nowhere
        out["log_metric"], out["log_extra"] = log.for_reward(self.caller)
        if self.completion_mask is not None:
            out["completion_mask"] = self.completion_mask
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.outcomes is not None:
            out["environment_scores"] = self.outcomes
        return out
