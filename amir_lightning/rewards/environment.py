"""The environment's own reward: an episode scored where it ran (``VerifiersEnvironment``'s taskset rewards)."""

from __future__ import annotations

from collections.abc import Sequence

from typing_extensions import override

from amir_lightning.rewards.base import Reward


class EnvironmentReward(Reward):
    """The reward the episode's environment gave it (``Episode.outcome``), e.g. a verifiers taskset's weighted sum.

    Each of the environment's named rewards and metrics is logged too, averaged over the rollout, as
    ``reward/<name>``. Outside such episodes it does not apply (``None``).

    Args:
        weight: Multiplier in the total reward.
        name: Metric name (default ``environment``).
    """

    @override
    def score(self, completions: Sequence, answers: Sequence[str], **kwargs) -> list[float | None]:
        outcomes = kwargs.get("environment_scores") or [None] * len(completions)
        log_metric = kwargs.get("log_metric")
        for outcome in outcomes:
            for name, value in {**(outcome or {}).get("rewards", {}), **(outcome or {}).get("metrics", {})}.items():
                if log_metric is not None and value is not None:
                    log_metric(name, value)
        return [None if outcome is None else outcome.get("reward") for outcome in outcomes]
