"""Rollout batches: groups of completions turned into padded micro-batches of whole groups.

A rollout becomes optimisation steps in three moves: ``plan_steps`` assigns whole groups to steps and micro-batches
(by count, or by a token budget with the groups sorted by length), ``fit_plan`` makes every process run the same
number of micro-batches per step (collectives under DDP and FSDP need it), and ``build_steps`` pads them into tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.loop.types import Group, Rollout
from amir_lightning.models.policy import Policy


@dataclass
class RolloutBatch:
    """A micro-batch of whole groups, padded: prompts on the left to width P, completions on the right to T.

    Attributes:
        input_ids: ``[n, P + T]`` prompt then completion tokens.
        attention_mask: ``[n, P + T]``.
        completion_mask: ``[n, T]`` 1.0 on the policy's own completion tokens, the tokens the loss trains on; 0.0 on
            padding and, inside a multi-turn episode, on an environment's replies (``Completion.loss_mask``).
        advantages: ``[n]``.
        rewards: ``[n]`` raw total rewards (pairs are mined from these).
        truncated: ``[n]`` bool, completion hit the length limit.
        correct: ``[n]`` 1.0 / 0.0 answer correctness (NaN when unknown), for the monitors.
        sampling_logps: ``[n, T]`` the engine's log-probs of the sampled tokens.
        group_size: ``G``.
        old_logps: ``[n, T]`` the trainer's log-probs of the tokens before the step's update, when the step is
            off-policy (later steps or passes, a rollout sampled ahead); set by ``score_old`` alone.
        filler: A stand-in that keeps this process in step with others that have more micro-batches: the module
            runs its forward and a zero backward, and it adds nothing to the loss, the gradient or the metrics.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    truncated: torch.Tensor
    correct: torch.Tensor
    sampling_logps: torch.Tensor
    group_size: int
    old_logps: torch.Tensor | None = None
    filler: bool = False

    @property
    def completion_width(self) -> int:
        """``T``."""
        return self.completion_mask.shape[1]

    @property
    def completion_ids(self) -> torch.Tensor:
        """``[n, T]``."""
        return self.input_ids[:, -self.completion_width :]

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """The batch of the given rows (in that order); the step's fields are kept as they are."""
        index = torch.as_tensor(rows, dtype=torch.long)
        fields = ("input_ids", "attention_mask", "completion_mask", "advantages", "rewards", "truncated", "correct")
        picked = {name: getattr(self, name)[index.to(getattr(self, name).device)] for name in fields}
        picked["sampling_logps"] = self.sampling_logps[index.to(self.sampling_logps.device)]
        if self.old_logps is not None:
            picked["old_logps"] = self.old_logps[index.to(self.old_logps.device)]
        return replace(self, **picked)


def make_groups(
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    correct: torch.Tensor,
    extra: dict[str, list] | None = None,
) -> list[Group]:
    """One ``Group`` per prompt from the rollout's flat ``[B * G]`` tensors and ``extra`` columns."""
    G = len(completions[0]) if completions else 0
    columns = extra or {}
    return [
        Group(
            ids,
            comps,
            rewards[i * G : (i + 1) * G],
            advantages[i * G : (i + 1) * G],
            correct[i * G : (i + 1) * G],
            p.answer,
            p.question,
            {name: values[i * G : (i + 1) * G] for name, values in columns.items()},
        )
        for i, (p, ids, comps) in enumerate(zip(prompts, prompt_ids, completions))
    ]


def make_batch(groups: list[Group], pad_id: int) -> RolloutBatch:
    """The groups' rows padded into one ``RolloutBatch``."""
    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    prompt_width = max(len(p) for p, _ in rows)
    completion_width = max(max(len(c.token_ids) for _, c in rows), 1)
    n = len(rows)
    input_ids = torch.full((n, prompt_width + completion_width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    completion_mask = torch.zeros((n, completion_width))
    sampling_logps = torch.zeros((n, completion_width))
    for row, (prompt, completion) in enumerate(rows):
        start = prompt_width - len(prompt)
        input_ids[row, start:prompt_width] = torch.tensor(prompt)
        attention[row, start:prompt_width] = 1
        length = len(completion.token_ids)
        if length:
            input_ids[row, prompt_width : prompt_width + length] = torch.tensor(completion.token_ids)
            attention[row, prompt_width : prompt_width + length] = 1
            own = completion.loss_mask
            completion_mask[row, :length] = 1.0 if own is None else torch.tensor(own[:length], dtype=torch.float)
            sampling_logps[row, :length] = torch.tensor(completion.sampling_logps[:length])
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        completion_mask=completion_mask,
        advantages=torch.cat([g.advantages for g in groups]).float(),
        rewards=torch.cat([g.rewards for g in groups]).float(),
        truncated=torch.tensor([c.truncated for _, c in rows]),
        correct=torch.cat([_correct(g) for g in groups]).float(),
        sampling_logps=sampling_logps,
        group_size=len(groups[0].completions),
    )


def _correct(group: Group) -> torch.Tensor:
    return group.correct if group.correct is not None else torch.full((len(group.completions),), float("nan"))


@dataclass
class RolloutStep:
    """One optimisation step: its micro-batches of whole groups, and the step-wide facts of all its completions.

    Attributes:
        micro_batches: The step's micro-batches (gradient accumulation), in order; fillers (``fit_plan``) last.
        lengths: ``[N]`` policy tokens of every completion of the step (``Completion.policy_tokens``, the sums of
            the loss mask: a tool's replies inside an episode are context, not counted), which the aggregations'
            normalisers and the token-normalised statistics divide by.
        rewards: ``[N]`` their rewards.
        truncated: ``[N]`` their truncation flags.
        group_size: ``G``.
        index: Index of the step in the epoch (passes over the rollout continue it).
        rollout: The rollout the step comes from (its groups, timings and metrics), for the read-only monitors,
            which see every step in ``on_train_batch_start`` / ``on_train_batch_end``.
    """

    micro_batches: list[RolloutBatch]
    lengths: torch.Tensor
    rewards: torch.Tensor
    truncated: torch.Tensor
    group_size: int
    index: int = 0
    # Not an init field: Lightning moves (and copies) a batch's init fields to the device each step; the rollout
    # is for the monitors and stays where it is.
    rollout: Rollout | None = field(default=None, init=False)


Plan = list[list[list[Group]]]
"""Steps, each a list of micro-batches, each a list of whole groups (an empty micro-batch is a filler)."""


def padded_tokens(groups: list[Group]) -> int:
    """Tokens of ``groups`` padded into one micro-batch: rows x (longest prompt + longest completion)."""
    if not groups:
        return 0
    rows = sum(len(g.completions) for g in groups)
    prompt = max(len(g.prompt_ids) for g in groups)
    completion = max(max(len(c.token_ids) for c in g.completions) for g in groups)
    return rows * (prompt + max(completion, 1))


def split_by_tokens(groups: list[Group], budget: int) -> list[list[Group]]:
    """Whole groups sorted by padded length, as many per micro-batch as fit in ``budget`` padded tokens.

    A group larger than the budget goes alone. Sorting puts groups of like lengths together, so little padding is
    left; the step's gradient does not depend on the split (its normalisers are step-wide).
    """
    parts: list[list[Group]] = []
    for group in sorted(groups, key=lambda g: padded_tokens([g])):
        if parts and padded_tokens([*parts[-1], group]) <= budget:
            parts[-1].append(group)
        else:
            parts.append([group])
    return parts


def plan_steps(
    groups: list[Group], steps_per_rollout: int, micro_batch_groups: int, micro_batch_tokens: int | None = None
) -> Plan:
    """Whole groups into exactly ``steps_per_rollout`` steps (in order), each split into micro-batches.

    The groups are spread evenly (the first steps take one more where they do not divide): a rollout keeps its
    step count whatever number of groups it trains on (dropped groups, dynamic sampling's rounds run out), so the
    LR schedule and the run's length hold. With fewer groups than steps, the last steps are empty: no process may
    have a group there (``agree_on_plan``), and the step then leaves the weights as they are.

    The split: ``micro_batch_tokens`` padded tokens at most (``split_by_tokens``), or else ``micro_batch_groups``
    groups per micro-batch, in order.
    """
    per_step, more = divmod(len(groups), steps_per_rollout)
    plan, first = [], 0
    for index in range(steps_per_rollout):
        step = groups[first : first + per_step + (index < more)]
        first += len(step)
        if micro_batch_tokens is not None:
            plan.append(split_by_tokens(step, micro_batch_tokens) if step else [])
        else:
            plan.append([step[s : s + micro_batch_groups] for s in range(0, len(step), micro_batch_groups)])
    return plan


def fit_plan(plan: Plan, counts: list[int]) -> Plan:
    """``plan`` with exactly ``counts[i]`` micro-batches in step ``i`` (the most any process has there).

    The micro-batch with most padded tokens is halved (at the point that balances the halves) until the count is
    reached; when no micro-batch has two groups left, empty micro-batches (fillers) make up the rest. A step with a
    count of 0 stays, empty: no process has a group there.
    """
    fitted = []
    for index, count in enumerate(counts):
        parts = [list(part) for part in (plan[index] if index < len(plan) else [])]
        if len(parts) > count:
            raise ValueError(f"step {index} has {len(parts)} micro-batches, more than the agreed {count}")
        while len(parts) < count:
            splittable = [i for i, part in enumerate(parts) if len(part) > 1]
            if not splittable:
                parts.extend([] for _ in range(count - len(parts)))
                break
            i = max(splittable, key=lambda i: padded_tokens(parts[i]))
            part = parts.pop(i)
            cut = min(range(1, len(part)), key=lambda c: max(padded_tokens(part[:c]), padded_tokens(part[c:])))
            parts[i:i] = [part[:cut], part[cut:]]
        fitted.append(parts)
    return fitted


def agree_on_plan(plan: Plan, steps_per_rollout: int, max_over_processes: Callable[[list[float]], list[float]]) -> Plan:
    """``plan`` fitted (``fit_plan``) to the micro-batches per step that every process runs: the most any has.

    Processes may hold different groups (those without reward variance dropped) and split them differently; every
    process must call it (``max_over_processes`` is a collective).
    """
    counts = [float(len(plan[i])) if i < len(plan) else 0.0 for i in range(steps_per_rollout)]
    return fit_plan(plan, [int(c) for c in max_over_processes(counts)])


def build_steps(
    plan: Plan, pad_id: int, passes: int = 1, filler: Group | None = None, rollout: Rollout | None = None
) -> list[RolloutStep]:
    """The optimisation schedule of a rollout: ``passes`` passes over the steps of ``plan``, padded.

    Empty micro-batches become fillers made of ``filler`` (any group of the rollout); an empty step (no process has
    a group there) has no micro-batches. Later passes share the first pass's micro-batches (the same objects) and
    continue its step indices. Every step refers to ``rollout``.
    """
    steps = []
    for index, parts in enumerate(plan):
        step_groups = [g for part in parts for g in part]
        if any(not part for part in parts) and filler is None:
            raise ValueError("the plan has filler micro-batches but no filler group was given")
        rows = [c for g in step_groups for c in g.completions]
        steps.append(
            RolloutStep(
                micro_batches=[make_batch(part, pad_id) if part else _filler(filler, pad_id) for part in parts],
                lengths=torch.tensor([c.policy_tokens for c in rows], dtype=torch.float),
                rewards=torch.cat([g.rewards for g in step_groups]).float() if step_groups else torch.zeros(0),
                truncated=torch.tensor([c.truncated for c in rows], dtype=torch.bool),
                group_size=len((step_groups or [filler])[0].completions),
                index=index,
            )
        )
    later = [replace(step, index=step.index + k * len(steps)) for k in range(1, passes) for step in steps]
    for step in steps + later:
        step.rollout = rollout
    return steps + later


def _filler(group: Group, pad_id: int) -> RolloutBatch:
    return replace(make_batch([group], pad_id), filler=True)


def batch_logps(policy: Policy, batch: RolloutBatch, temperature: float | None = None) -> torch.Tensor:
    """``[n, T]`` log-probs of ``batch``'s completion tokens under the policy's current weights, no gradient."""
    return policy.logps(batch.input_ids, batch.attention_mask, batch.completion_width, temperature)


def score_old(policy: Policy, batches: list[RolloutBatch], weights: dict[str, torch.Tensor] | None = None) -> None:
    """Set each batch's ``old_logps``, the policy ratio's denominator: the trainer's log-probs of its tokens.

    The one writer of ``old_logps``. Under the current weights, or under ``weights``
    (``Policy.trainable_weights``'s: those that sampled a rollout the trainer has moved on from). Scored on the
    micro-batches the steps train, so that under the current weights the first step's ratio is exactly 1.
    """
    with policy.swapped(weights) if weights else nullcontext():
        for batch in batches:
            batch.old_logps = batch_logps(policy, batch)
