"""Evaluation rollouts: n samples per problem through the rollout engine, graded by the sandboxed grader."""

from __future__ import annotations

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.rollout.batch import Group
from amir_lightning.rollout.engine import SamplingConfig


def evaluate_prompts(datamodule, name: str, prompts: list[Prompt], samples: int, sampling: SamplingConfig) -> dict:
    """Generate ``samples`` completions per prompt with the (synced) engine and grade them.

    Returns the evaluation batch: ``benchmark``, ``correct`` and ``lengths`` ``[P, samples]``, and ``groups``
    (one ``Group`` per problem, rewards = correctness) so the module can score the samples with the policy.
    """
    prompt_ids = datamodule.tokenize(prompts)
    datamodule.sync(prompt_ids[0], prompts[0].answer)
    completions = datamodule.engine.generate(prompt_ids, samples, sampling)
    texts = [c.text for group in completions for c in group]
    answers = [p.answer for p in prompts for _ in range(samples)]
    correct = torch.tensor(datamodule.grader().correctness(texts, answers)).view(len(prompts), samples)
    lengths = torch.tensor([len(c.token_ids) for g in completions for c in g], dtype=torch.float)
    groups = [
        Group(ids, group, correct[i].clone(), torch.zeros(samples), correct[i].clone(), p.answer, p.question)
        for i, (ids, group, p) in enumerate(zip(prompt_ids, completions, prompts))
    ]
    return {
        "benchmark": name,
        "correct": correct,
        "lengths": lengths.view(len(prompts), samples),
        "groups": groups,
        "temperature": sampling.temperature,
    }
