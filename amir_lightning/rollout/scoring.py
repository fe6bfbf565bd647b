"""Scoring a rollout: weighted reward sum, per-reward and length metrics."""

from __future__ import annotations

import math

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.engine import Completion


def score_completions(
    rewards: list[Reward], prompts: list[Prompt], completions: list[list[Completion]]
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Total rewards ``[B * G]`` (groups contiguous), the rollout metrics, and correctness ``[B * G]``.

    Correctness (1.0 / 0.0) comes from the first ``MathAnswerReward``; it is NaN when there is none, and the
    monitors then skip their correct/incorrect split.

    A reward function that returns NaN or inf is a bug in that reward: it is named in the error rather than
    trained on.
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
        if not torch.isfinite(values).all():
            bad = int((~torch.isfinite(values)).sum())
            raise ValueError(f"reward {reward.name} returned {bad} non-finite scores (NaN or inf)")
        metrics[f"rollout/reward/{reward.name}"] = values.mean().item()
        if isinstance(reward, MathAnswerReward) and correct.isnan().all():
            correct = (values == reward.correct_score).float()
        total += reward.weight * values
    lengths = torch.tensor([len(c.token_ids) for group in completions for c in group], dtype=torch.float32)
    truncated = torch.tensor([c.truncated for group in completions for c in group], dtype=torch.float32)
    metrics.update(
        {
            "rollout/reward_mean": total.mean().item(),
            "rollout/reward_std": total.std().item() if total.numel() > 1 else 0.0,
            "length/mean": lengths.mean().item(),
            "length/max": lengths.max().item(),
            "length/truncated_frac": truncated.mean().item(),
        }
    )
    if not correct.isnan().all():
        metrics["rollout/accuracy"] = correct.mean().item()
    return total, {k: (0.0 if math.isnan(v) else v) for k, v in metrics.items()}, correct
