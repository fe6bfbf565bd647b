"""Rollout batches: groups of completions turned into padded micro-batches of whole groups."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
        step_lengths: ``[N]`` completion lengths of every completion of the optimisation step.
        step_rewards: ``[N]`` rewards of the step.
        step_truncated: ``[N]`` truncation flags of the step.
        group_size: ``G``.
        step: Index of the optimisation step in the epoch.
        last_in_step: The optimiser steps after this micro-batch.
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
    step_lengths: torch.Tensor
    step_rewards: torch.Tensor
    step_truncated: torch.Tensor
    group_size: int
    step: int
    last_in_step: bool
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


def collate_groups(groups: list[Group], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad the groups' rows into the tensors of a ``RolloutBatch`` (without the step fields)."""
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
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "sampling_logps": sampling_logps,
        "advantages": torch.cat([g.advantages for g in groups]).float(),
        "rewards": torch.cat([g.rewards for g in groups]).float(),
        "truncated": torch.tensor([c.truncated for _, c in rows]),
        "correct": torch.cat([_correct(g) for g in groups]).float(),
    }


def _correct(group: Group) -> torch.Tensor:
    return group.correct if group.correct is not None else torch.full((len(group.completions),), float("nan"))


def build_micro_batches(
    groups: list[Group], micro_batch_groups: int, steps_per_rollout: int, pad_id: int
) -> list[RolloutBatch]:
    """One pass of a rollout: ``steps_per_rollout`` optimisation steps of whole groups, split into micro-batches.

    Each step is split into micro-batches of ``micro_batch_groups`` groups (gradient accumulation).
    """
    if not groups:
        return []
    group_size = len(groups[0].completions)
    per_step = -(-len(groups) // steps_per_rollout)  # ceil
    batches: list[RolloutBatch] = []
    for step, first in enumerate(range(0, len(groups), per_step)):
        step_groups = groups[first : first + per_step]
        rows = [c for g in step_groups for c in g.completions]
        summary = {
            "step_lengths": torch.tensor([len(c.token_ids) for c in rows], dtype=torch.float),
            "step_rewards": torch.cat([g.rewards for g in step_groups]).float(),
            "step_truncated": torch.tensor([c.truncated for c in rows]),
        }
        starts = range(0, len(step_groups), micro_batch_groups)
        for k, start in enumerate(starts):
            fields = collate_groups(step_groups[start : start + micro_batch_groups], pad_id)
            last = k == len(starts) - 1
            batches.append(RolloutBatch(**fields, **summary, group_size=group_size, step=step, last_in_step=last))
    return batches


def repeat_passes(batches: list[RolloutBatch], mu: int) -> list[RolloutBatch]:
    """The optimisation schedule: ``mu`` passes over the micro-batches (tensors shared, step indices continued)."""
    steps = (batches[-1].step + 1) if batches else 0
    return [replace(b, step=b.step + k * steps) for k in range(mu) for b in batches]
