"""Rollout batches: groups of completions turned into padded micro-batches of whole groups."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.rollout.engine import Completion


@dataclass
class Group:
    """The G completions of one prompt, with their rewards and advantages.

    Attributes:
        prompt_ids: Tokenised prompt (chat template applied).
        completions: The G completions.
        rewards: ``[G]`` total (weighted) rewards.
        advantages: ``[G]`` group advantages.
        correct: ``[G]`` 1.0 / 0.0 answer correctness (NaN when no reward grades correctness).
        answer: Reference answer of the prompt.
        question: The prompt's question text.
    """

    prompt_ids: list[int]
    completions: list[Completion]
    rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor | None = None
    answer: str = ""
    question: str = ""


@dataclass
class RolloutBatch:
    """A micro-batch of whole groups, padded: prompts on the left to width P, completions on the right to T.

    Attributes:
        input_ids: ``[n, P + T]`` prompt then completion tokens.
        attention_mask: ``[n, P + T]``.
        completion_mask: ``[n, T]`` 1.0 on completion tokens.
        advantages: ``[n]``.
        rewards: ``[n]`` raw total rewards (pairs are mined from these).
        truncated: ``[n]`` bool, completion hit the length limit.
        correct: ``[n]`` 1.0 / 0.0 answer correctness (NaN when unknown), for the monitors.
        sampling_logps: ``[n, T]`` the engine's log-probs of the sampled tokens.
        group_size: ``G``.
        old_logps: ``[n, T]`` log-probs of the sampling policy from the trainer, when the step is off-policy.
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
) -> list[Group]:
    """One ``Group`` per prompt from the rollout's flat ``[B * G]`` tensors."""
    G = len(completions[0]) if completions else 0
    return [
        Group(
            ids,
            comps,
            rewards[i * G : (i + 1) * G],
            advantages[i * G : (i + 1) * G],
            correct[i * G : (i + 1) * G],
            p.answer,
            p.question,
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
            completion_mask[row, :length] = 1.0
            sampling_logps[row, :length] = torch.tensor(completion.logprobs[:length])
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
        micro_batches: The step's micro-batches (gradient accumulation), in order.
        lengths: ``[N]`` completion lengths of every completion of the step.
        rewards: ``[N]`` their rewards.
        truncated: ``[N]`` their truncation flags.
        group_size: ``G``.
        index: Index of the step in the epoch (passes over the rollout continue it).
        rollout: Set on the rollout's first step when later steps are off-policy (several steps or passes per
            rollout): the micro-batches of every step of one pass, whose log-probs under the sampling policy (the
            weights before this step's update) the module takes first, as the old policy of the ratios.
    """

    micro_batches: list[RolloutBatch]
    lengths: torch.Tensor
    rewards: torch.Tensor
    truncated: torch.Tensor
    group_size: int
    index: int = 0
    rollout: list[list[RolloutBatch]] = field(default_factory=list)


def build_steps(
    groups: list[Group], micro_batch_groups: int, steps_per_rollout: int, pad_id: int, mu: int = 1
) -> list[RolloutStep]:
    """The optimisation schedule of a rollout: ``mu`` passes of ``steps_per_rollout`` steps of whole groups.

    Each step is split into micro-batches of ``micro_batch_groups`` groups (gradient accumulation). Later passes
    share the first pass's tensors and continue its step indices. When any step follows an update of the policy
    (``mu`` or ``steps_per_rollout`` above 1), the first step carries the whole pass in ``rollout``.
    """
    if not groups:
        return []
    per_step = -(-len(groups) // steps_per_rollout)  # ceil
    steps = []
    for index, first in enumerate(range(0, len(groups), per_step)):
        step_groups = groups[first : first + per_step]
        rows = [c for g in step_groups for c in g.completions]
        starts = range(0, len(step_groups), micro_batch_groups)
        steps.append(
            RolloutStep(
                micro_batches=[make_batch(step_groups[s : s + micro_batch_groups], pad_id) for s in starts],
                lengths=torch.tensor([len(c.token_ids) for c in rows], dtype=torch.float),
                rewards=torch.cat([g.rewards for g in step_groups]).float(),
                truncated=torch.tensor([c.truncated for c in rows]),
                group_size=len(step_groups[0].completions),
                index=index,
            )
        )
    if mu > 1 or len(steps) > 1:
        steps[0].rollout = [step.micro_batches for step in steps]
    later = [replace(step, index=step.index + k * len(steps), rollout=[]) for k in range(1, mu) for step in steps]
    return steps + later
