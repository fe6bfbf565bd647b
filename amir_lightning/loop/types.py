"""The data a rollout is made of, from the engine's completions to the steps that train on them.

``Group``: the G completions of one prompt with their rewards and advantages; ``Rollout``: one collected rollout,
its groups and metrics. The batches built from them (``RolloutBatch``, ``RolloutStep``) live with their builder in
``loop/batch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from amir_lightning.engines.base import Completion


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
        extra: Columns the rewards logged (``log_extra``), ``G`` values each, for the sample table.
    """

    prompt_ids: list[int]
    completions: list[Completion]
    rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor | None = None
    answer: str = ""
    question: str = ""
    extra: dict[str, list] = field(default_factory=dict)


@dataclass
class Rollout:
    """One collected rollout.

    Attributes:
        groups: One ``Group`` per prompt, in prompt order.
        metrics: This process's rollout metrics (``rollout/*``, ``length/*``), not yet averaged over processes.
        seconds: Wall time of ``generate`` and ``score``.
        tokens: Completion tokens generated: the policy's own (``Completion.policy_tokens``).
        old_weights: The trainable weights under which the trainer scores the ratios' old log-probs, when they are
            not the current ones (sampled ahead with ``stale_logps: sampler``: the weights that sampled it).
    """

    groups: list[Group]
    metrics: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    old_weights: dict[str, torch.Tensor] | None = None

    @property
    def zero_std(self) -> list[bool]:
        """Per group: all its rewards are equal (no policy gradient)."""
        return [bool((g.rewards == g.rewards[0]).all()) for g in self.groups]

    @property
    def unscored(self) -> list[bool]:
        """Per group: a reward is NaN or infinite (a broken reward; ``loop/rewarding.py``)."""
        return [not bool(torch.isfinite(g.rewards).all()) for g in self.groups]

    def trained_groups(self, drop_zero_std: bool) -> list[Group]:
        """The groups the step trains on: every scored group, or those with reward variance.

        A group with a non-finite reward is never trained on: its advantages are zeroed, and counted in the step's
        normalisers it would shrink every other group's gradient (NaN is not equal to NaN, so it is not "zero std").
        """
        return [
            g
            for g, zero, bad in zip(self.groups, self.zero_std, self.unscored)
            if not bad and not (drop_zero_std and zero)
        ]
