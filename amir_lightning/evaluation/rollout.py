"""Evaluation rollouts: n samples per problem through the rollout engine, graded by the sandboxed grader."""

from __future__ import annotations

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.rollout.batch import Group
from amir_lightning.rollout.engine import SamplingConfig


def evaluate_prompts(
    datamodule, name: str, prompts: list[Prompt], samples: int, sampling: SamplingConfig, purpose: int = 1
) -> dict:
    """Generate ``samples`` completions per prompt with the (synced) engine and grade them.

    Returns the evaluation batch: ``benchmark``, ``correct`` and ``lengths`` ``[P, samples]``, and ``groups``
    (one ``Group`` per problem, rewards = correctness) so the module can score the samples with the policy.
    """
    prompt_ids = datamodule.tokenize(prompts)
    datamodule.sync(prompt_ids[0], prompts[0].answer)
    completions = datamodule.generate(prompt_ids, samples, sampling, purpose)
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


def validation_batches(datamodule) -> list[dict]:
    """The held-out evaluation during ``fit`` and in ``amir validate``: the first ``val_size`` of ``val_prompts``."""
    source = datamodule.val_prompts
    if source is None:
        return []
    prompts = [source[i] for i in range(min(datamodule.val_size, len(source)))]
    return [evaluate_prompts(datamodule, "heldout", prompts, datamodule.val_samples, datamodule.val_sampling)]


def test_batches(datamodule) -> list[dict]:
    """``amir test``: every problem of every benchmark (else the held-out prompts), one batch per benchmark."""
    benchmarks = datamodule.benchmarks
    sources = benchmarks or ([datamodule.val_prompts] if datamodule.val_prompts is not None else [])
    if not sources:
        raise ValueError("amir test needs data.benchmarks or data.val_prompts")
    batches = []
    for source in sources:
        size = len(source) if benchmarks else min(datamodule.val_size, len(source))
        prompts = [source[i] for i in range(size)]
        name = getattr(source, "name", "heldout")
        samples, sampling = datamodule.eval_samples, datamodule.eval_sampling
        batches.append(evaluate_prompts(datamodule, name, prompts, samples, sampling, purpose=2))
    return batches
