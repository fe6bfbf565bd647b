"""Scoring a rollout: weighted reward sum, per-reward and length metrics."""

from __future__ import annotations

import logging
import math

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.engine import Completion

log = logging.getLogger(__name__)


class RewardGuard:
    """Warns about rollouts with NaN or inf rewards and stops after ``max_bad_rollouts`` of them in a row.

    Args:
        max_bad_rollouts: Consecutive rollouts with non-finite rewards tolerated (``data.max_bad_rollouts``).
    """

    def __init__(self, max_bad_rollouts: int = 3) -> None:
        if max_bad_rollouts < 1:
            raise ValueError(f"data.max_bad_rollouts must be >= 1, got {max_bad_rollouts}")
        self.max_bad_rollouts, self.in_a_row = max_bad_rollouts, 0

    def check(self, metrics: dict[str, float]) -> None:
        """Inspect a rollout's metrics (``rollout/nonfinite/<reward>`` counts)."""
        bad = {k.rsplit("/", 1)[1]: int(v) for k, v in metrics.items() if k.startswith("rollout/nonfinite/")}
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if not bad:
            return
        message = f"reward(s) returned NaN or inf for {bad} completions; their groups are not trained on"
        if self.in_a_row >= self.max_bad_rollouts:
            raise ValueError(
                f"{message}, and {self.in_a_row} rollouts in a row had such rewards "
                f"(data.max_bad_rollouts={self.max_bad_rollouts}): fix the reward function"
            )
        log.warning("%s (%d rollouts in a row)", message, self.in_a_row)


def score_completions(
    rewards: list[Reward], prompts: list[Prompt], completions: list[list[Completion]]
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Total rewards ``[B * G]`` (groups contiguous), the rollout metrics, and correctness ``[B * G]``.

    Correctness (1.0 / 0.0) comes from the first ``MathAnswerReward``; it is NaN when there is none, and the
    monitors then skip their correct/incorrect split.

    A NaN or inf score (a bug in a reward function) makes that completion's total NaN: its group gets zero
    advantage and no pairs, so it is never trained on, and ``rollout/nonfinite_rewards`` counts it (the data
    module warns and stops after ``data.max_bad_rollouts`` such rollouts in a row).
    """
    texts = [c.text for group in completions for c in group]
    answers = [p.answer for p, group in zip(prompts, completions) for _ in group]
    total = torch.zeros(len(texts), dtype=torch.float32)
    correct = torch.full((len(texts),), float("nan"))
    metrics: dict[str, float] = {}
    for reward in rewards:
        values = torch.tensor(reward.score(texts, answers), dtype=torch.float32)
        if values.shape != total.shape:
            raise ValueError(f"reward {reward.name} returned {values.numel()} scores for {len(texts)} completions")
        finite = torch.isfinite(values)
        if not finite.all():
            metrics[f"rollout/nonfinite/{reward.name}"] = float((~finite).sum())
            values = values.masked_fill(~finite, float("nan"))
        metrics[f"rollout/reward/{reward.name}"] = values.nanmean().item()
        if isinstance(reward, MathAnswerReward) and correct.isnan().all():
            correct = (values == reward.correct_score).float()
        total += reward.weight * values
    lengths = torch.tensor([len(c.token_ids) for group in completions for c in group], dtype=torch.float32)
    truncated = torch.tensor([c.truncated for group in completions for c in group], dtype=torch.float32)
    good = total[~total.isnan()]
    metrics.update(
        {
            "rollout/reward_mean": good.mean().item() if good.numel() else float("nan"),
            "rollout/reward_std": good.std().item() if good.numel() > 1 else 0.0,
            "rollout/nonfinite_rewards": float(total.isnan().sum()),
            "length/mean": lengths.mean().item(),
            "length/max": lengths.max().item(),
            "length/truncated_frac": truncated.mean().item(),
        }
    )
    if not correct.isnan().all():
        metrics["rollout/accuracy"] = correct.mean().item()
    return total, {k: (0.0 if math.isnan(v) else v) for k, v in metrics.items()}, correct
