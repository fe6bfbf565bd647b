"""Evaluation rollouts: n samples per problem through the rollout engine, graded by the sandboxed grader."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.engines.base import SamplingConfig
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.loop.schedule import At, Schedule
from amir_lightning.loop.types import Group
from amir_lightning.rewards.math import MathAnswerReward


@dataclass
class EvaluationSettings:
    """Validation during ``fit`` and in ``amir validate``, and the benchmarks of ``amir test`` (``data.evaluation``).

    Attributes:
        val_size: Held-out prompts evaluated (the first ``val_size`` of ``data.val_prompts``).
        val_samples: Samples per held-out prompt.
        val_sampling: Sampling of validation (default: the paper's temperature 0.6, top_p 1.0, the training length
            limit).
        samples: Samples per problem in ``amir test`` (the paper: 8).
        sampling: Sampling in ``amir test`` (default as ``val_sampling``).
        ks: The k of ``eval/<benchmark>/pass@k`` (the paper: 1, 2, 4); each must be <= ``samples``.
        logps: Per-sample mean log-probs in the reports (for ``amir compare`` margins): ``engine`` (free, at the
            evaluation temperature) or ``policy`` (a forward over every sample, temperature 1).
    """

    val_size: int = 64
    val_samples: int = 4
    val_sampling: SamplingConfig | None = None
    samples: int = 8
    sampling: SamplingConfig | None = None
    ks: list[int] = field(default_factory=lambda: [1, 2, 4])
    logps: Literal["engine", "policy"] = "engine"

    def __post_init__(self) -> None:
        errors: list[str] = []
        for key in ("val_size", "val_samples", "samples"):
            check_number(errors, f"data.evaluation.{key}", getattr(self, key), ge=1)
        if not errors and (not self.ks or min(self.ks) < 1 or max(self.ks) > self.samples):
            errors.append(
                f"data.evaluation.ks {self.ks} must lie in [1, data.evaluation.samples={self.samples}] for pass@k"
            )
        raise_errors(errors)

    def prompt_sets(
        self, stage: str, benchmarks: Sequence[PromptSource], heldout: PromptSource | None
    ) -> list[tuple[PromptSource, int]]:
        """The prompt sources ``stage`` evaluates, with how many prompts of each (the first ones).

        ``test``: every problem of every benchmark, else the first ``val_size`` held-out prompts, as for ``fit`` and
        ``validate``.
        """
        if stage == "test" and benchmarks:
            return [(source, len(source)) for source in benchmarks]
        if heldout is None or stage not in ("fit", "validate", "test"):
            return []
        return [(heldout, min(self.val_size, len(heldout)))]

    def with_length_limit(self, max_new_tokens: int) -> EvaluationSettings:
        """These settings with the paper's evaluation sampling (temperature 0.6, top_p 1.0) where none is given."""
        paper = SamplingConfig(temperature=0.6, top_p=1.0, max_new_tokens=max_new_tokens)
        return replace(self, val_sampling=self.val_sampling or paper, sampling=self.sampling or paper)


class Evaluator:
    """Held-out validation and ``amir test`` benchmarks: sample, grade, and batch the results per benchmark.

    It samples through the training schedule (``Schedule.sample_evaluation``), so evaluation renders, pushes and
    seeds exactly as training does.

    Args:
        settings: Sizes, samples, sampling and the k of pass@k (``with_length_limit`` applied).
        schedule: The run's schedule: the push of this step's weights, then seeded sampling.
        at: Where the run stands (the step of the push and of the seeds).
        grader: The correctness check (a ``MathAnswerReward``).
        progress: Show a progress bar while the answers are graded.
    """

    def __init__(
        self, settings: EvaluationSettings, schedule: Schedule, at: At, grader: MathAnswerReward, progress: bool = False
    ) -> None:
        self.settings, self.schedule, self.at, self.grader, self.progress = settings, schedule, at, grader, progress
        self.sync_metrics: dict[str, float] = {}  # of the push before the first sampling (once per step)

    def evaluate(
        self, name: str, prompts: list[Prompt], samples: int, sampling: SamplingConfig, purpose: int = 1
    ) -> dict:
        """Generate ``samples`` completions per prompt with the synced engine and grade them.

        Returns the evaluation batch: ``benchmark``, ``correct`` and ``lengths`` ``[P, samples]``, ``groups`` (one
        ``Group`` per problem, rewards = correctness, so the module can score the samples with the policy) and
        ``temperature``; ``environment_reward`` ``[P, samples]`` where the environment scored every episode (a
        verifiers taskset's reward: ``val/environment_reward``).
        """
        prompt_ids, completions, sync = self.schedule.sample_evaluation(self.at, prompts, samples, sampling, purpose)
        self.sync_metrics |= sync
        texts = [c.text for group in completions for c in group]
        answers = [p.answer for p in prompts for _ in range(samples)]
        label = f"grading {name}" if self.progress else None
        correct = torch.tensor(self.grader.correctness(texts, answers, label)).view(len(prompts), samples)
        lengths = torch.tensor([len(c.token_ids) for g in completions for c in g], dtype=torch.float)
        groups = [
            Group(ids, group, correct[i].clone(), torch.zeros(samples), correct[i].clone(), p.answer, p.question)
            for i, (ids, group, p) in enumerate(zip(prompt_ids, completions, prompts))
        ]
        batch = {
            "benchmark": name,
            "correct": correct,
            "lengths": lengths.view(len(prompts), samples),
            "groups": groups,
            "temperature": sampling.temperature,
        }
        outcomes = [c.episode.outcome if c.episode else None for group in completions for c in group]
        if all(o is not None and o.get("reward") is not None for o in outcomes):  # the environment's own scoring
            batch["environment_reward"] = torch.tensor([o["reward"] for o in outcomes]).view(len(prompts), samples)
        return batch

    def validation_batches(self, source: PromptSource | None) -> list[dict]:
        """The held-out evaluation of ``fit`` and ``amir validate``: the first ``val_size`` prompts of ``source``."""
        s = self.settings
        return [
            self.evaluate("heldout", [source[i] for i in range(count)], s.val_samples, s.val_sampling)
            for source, count in s.prompt_sets("validate", [], source)
        ]

    def test_batches(self, benchmarks: Sequence[PromptSource], heldout: PromptSource | None) -> list[dict]:
        """``amir test``: every problem of every benchmark (else the held-out prompts), one batch per benchmark.

        Each batch also carries the ``ks`` of its pass@k and where its per-sample log-probs come from (``logps``).
        """
        s, batches = self.settings, []
        sets = s.prompt_sets("test", benchmarks, heldout)
        if not sets:
            raise ValueError("amir test needs data.benchmarks or data.val_prompts")
        for source, count in sets:
            prompts = [source[i] for i in range(count)]
            batch = self.evaluate(getattr(source, "name", "heldout"), prompts, s.samples, s.sampling, purpose=2)
            batches.append({**batch, "ks": list(s.ks), "logps": s.logps})
        return batches
