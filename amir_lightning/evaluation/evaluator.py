"""Evaluation rollouts: n samples per problem through the rollout engine, graded by the sandboxed grader."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.batch import Group
from amir_lightning.rollout.engine import Completion, SamplingConfig


class Evaluator:
    """Held-out validation and ``amir test`` benchmarks: sample, grade, and batch the results per benchmark.

    The rollout data module composes it from its own steps, so evaluation samples exactly as training does.

    Args:
        tokenize: Prompts to chat-templated token ids.
        sync: ``(probe prompt ids, probe answer)``: push the policy's weights into the engine (once per step).
        generate: ``(prompt ids, n, sampling, purpose)``: ``n`` seeded completions per prompt.
        grader: The correctness check (a ``MathAnswerReward``).
    """

    def __init__(
        self,
        tokenize: Callable[[list[Prompt]], list[list[int]]],
        sync: Callable[[list[int], str], float],
        generate: Callable[[list[list[int]], int, SamplingConfig, int], list[list[Completion]]],
        grader: MathAnswerReward,
    ) -> None:
        self.tokenize, self.sync, self.generate, self.grader = tokenize, sync, generate, grader

    def evaluate(
        self, name: str, prompts: list[Prompt], samples: int, sampling: SamplingConfig, purpose: int = 1
    ) -> dict:
        """Generate ``samples`` completions per prompt with the synced engine and grade them.

        Returns the evaluation batch: ``benchmark``, ``correct`` and ``lengths`` ``[P, samples]``, ``groups`` (one
        ``Group`` per problem, rewards = correctness, so the module can score the samples with the policy) and
        ``temperature``.
        """
        prompt_ids = self.tokenize(prompts)
        self.sync(prompt_ids[0], prompts[0].answer)
        completions = self.generate(prompt_ids, samples, sampling, purpose)
        texts = [c.text for group in completions for c in group]
        answers = [p.answer for p in prompts for _ in range(samples)]
        correct = torch.tensor(self.grader.correctness(texts, answers)).view(len(prompts), samples)
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

    def validation_batches(
        self, source: PromptSource | None, size: int, samples: int, sampling: SamplingConfig
    ) -> list[dict]:
        """The held-out evaluation of ``fit`` and ``amir validate``: the first ``size`` prompts of ``source``."""
        if source is None:
            return []
        prompts = [source[i] for i in range(min(size, len(source)))]
        return [self.evaluate("heldout", prompts, samples, sampling)]

    def test_batches(
        self,
        benchmarks: Sequence[PromptSource],
        heldout: PromptSource | None,
        heldout_size: int,
        samples: int,
        sampling: SamplingConfig,
        ks: list[int],
        logps: str,
    ) -> list[dict]:
        """``amir test``: every problem of every benchmark (else the held-out prompts), one batch per benchmark.

        Each batch also carries the ``ks`` of its pass@k and where its per-sample log-probs come from (``logps``).
        """
        sources = list(benchmarks) or ([heldout] if heldout is not None else [])
        if not sources:
            raise ValueError("amir test needs data.benchmarks or data.val_prompts")
        batches = []
        for source in sources:
            size = len(source) if benchmarks else min(heldout_size, len(source))
            prompts = [source[i] for i in range(size)]
            batch = self.evaluate(getattr(source, "name", "heldout"), prompts, samples, sampling, purpose=2)
            batches.append({**batch, "ks": list(ks), "logps": logps})
        return batches
