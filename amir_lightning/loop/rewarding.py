"""Scoring a rollout's completions: every reward on every completion, their weighted total and the answers' correctness.

``score_completions`` calls the rewards (the ``concurrent`` ones on threads of their own), checks what each returns,
and sums them with their weights; ``Scores`` keeps the result with the time it took, so a rollout sampled ahead is
scored once, and its checkpoint keeps the scores (``loop/pending.py``). ``RewardGuard`` stops a run whose rewards
keep failing.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.rewards.base import Reward, call_reward
from amir_lightning.rewards.inputs import RewardInputs, RewardLog, RunState
from amir_lightning.rewards.math import MathAnswerReward

log = logging.getLogger(__name__)


class RewardGuard:
    """Warns about rollouts with NaN or inf rewards and stops after ``max_bad_rollouts`` of them in a row.

    Args:
        max_bad_rollouts: Consecutive rollouts with non-finite rewards tolerated (``data.rollout.max_bad_rollouts``).
    """

    def __init__(self, max_bad_rollouts: int = 3) -> None:
        if max_bad_rollouts < 1:
            raise ValueError(f"data.rollout.max_bad_rollouts must be >= 1, got {max_bad_rollouts}")
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
                f"(data.rollout.max_bad_rollouts={self.max_bad_rollouts}): fix the reward function"
            )
        log.warning("%s (%d rollouts in a row)", message, self.in_a_row)


def _values(reward: Reward, raw: list, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward's output as ``[N]`` values (NaN where it does not apply) and ``[N]`` applies flags."""
    if isinstance(raw, str | bytes | dict) or not hasattr(raw, "__iter__"):
        raise ValueError(
            f"reward {reward.name} returned {raw!r:.60}: expected a list of {count} scores, one per completion "
            "(a number, or None where it does not apply) (data.rewards)"
        )
    raw = list(raw)
    if len(raw) != count:
        raise ValueError(f"reward {reward.name} returned {len(raw)} scores for {count} completions (data.rewards)")
    values = torch.full((count,), float("nan"))
    for i, value in enumerate(raw):
        if value is None:
            continue
        try:
            values[i] = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward {reward.name} returned {value!r} for completion {i}: expected a number or None (data.rewards)"
            ) from None
    return values, torch.tensor([v is not None for v in raw], dtype=torch.bool)


def _call_all(rewards: list[Reward], inputs: RewardInputs, warn_s: float) -> list[list]:
    """Every reward's scores, in order; the ``concurrent`` ones on threads of their own while the others run here."""
    concurrent = [i for i, r in enumerate(rewards) if r.concurrent]
    if not concurrent:
        return [call_reward(r, inputs, warn_s) for r in rewards]
    with ThreadPoolExecutor(max_workers=len(concurrent), thread_name_prefix="reward") as pool:
        running = {i: pool.submit(call_reward, rewards[i], inputs, warn_s) for i in concurrent}
        here = {i: call_reward(r, inputs, warn_s) for i, r in enumerate(rewards) if i not in running}
        return [running[i].result() if i in running else here[i] for i in range(len(rewards))]


def score_completions(
    rewards: list[Reward],
    prompts: list[Prompt],
    completions: list[list[Completion]],
    warn_s: float = 60.0,
    state: RunState | None = None,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, dict[str, list]]:
    """Total rewards ``[B * G]`` (groups contiguous), the rollout metrics, correctness ``[B * G]``, logged columns.

    The logged columns are what reward functions gave ``log_extra``, ``[B * G]`` values each. Every reward sees the
    same ``RewardInputs`` (TRL's keyword arguments, ``state`` as ``trainer_state``). A reward returning ``None`` for a
    completion does not apply to it: it adds nothing to its total and is left out of ``rollout/reward/<name>``
    (TRL's rule); a completion no reward applies to totals 0 and is counted in ``rollout/unscored``.

    Correctness (1.0 / 0.0) comes from the first ``MathAnswerReward``; it is NaN where that does not apply or when
    there is none, and the monitors then skip their correct/incorrect split.

    ``length/mean`` and ``length/max`` count the policy's own tokens (``Completion.policy_tokens``, what the loss
    trains on and the length-bias monitor measures); a tool's replies inside an episode are ``tools/reply_tokens``.

    A NaN or inf score (a bug in a reward function) makes that completion's total NaN: its group gets zero
    advantage and no pairs, so it is never trained on, and ``rollout/nonfinite_rewards`` counts it (``RewardGuard``
    warns and stops after ``data.rollout.max_bad_rollouts`` such rollouts in a row).

    What a reward says of its call (``Reward.metrics``) is logged as ``<name>/<key>`` (``judge/unparsed_frac``), and
    what reward functions give ``log_metric`` as ``reward/<name>``.
    """
    rows = [(p, c) for p, group in zip(prompts, completions) for c in group]
    episodes = [c.episode for _, c in rows]  # None for a single-turn completion
    with_tools = any(e is not None and e.messages is not None for e in episodes)  # tool calls: messages and calls
    outcomes = [e.outcome if e is not None else None for e in episodes]
    logged = RewardLog(len(rows))
    inputs = RewardInputs(
        [c.text for _, c in rows],
        [p for p, _ in rows],
        [c.token_ids for _, c in rows],
        [c.finish_reason for _, c in rows],
        [e.messages if e is not None else None for e in episodes] if with_tools else None,
        [e.calls if e is not None else None for e in episodes] if with_tools else None,
        outcomes if any(o is not None for o in outcomes) else None,
        state or RunState(),
        logged,
        completion_mask=[c.loss_mask for _, c in rows] if any(c.loss_mask is not None for _, c in rows) else None,
    )
    count = len(rows)
    total = torch.zeros(count, dtype=torch.float32)
    applied = torch.zeros(count, dtype=torch.long)
    correct = torch.full((count,), float("nan"))
    metrics: dict[str, float] = {}
    found_grader = False
    for reward, raw in zip(rewards, _call_all(rewards, inputs, warn_s)):
        values, applies = _values(reward, raw, count)
        bad = applies & ~torch.isfinite(values)
        if bad.any():
            metrics[f"rollout/nonfinite/{reward.name}"] = float(bad.sum())
            values = values.masked_fill(bad, float("nan"))  # inf too: the total must read as NaN
        if applies.any():
            metrics[f"rollout/reward/{reward.name}"] = values[applies & ~bad].mean().item()
        if isinstance(reward, MathAnswerReward) and not found_grader:
            found_grader = True
            correct = torch.where(applies, (values == reward.correct_score).float(), correct)
        # where() keeps the NaN of a non-finite score (the group is then dropped) and adds 0 where it does not apply
        total += reward.weight * torch.where(applies, values, torch.zeros_like(values))
        applied += applies.long()
        metrics.update({f"{reward.name}/{key}": value for key, value in reward.metrics().items()})
    lengths = torch.tensor([c.policy_tokens for _, c in rows], dtype=torch.float32)  # a tool's replies: not counted
    truncated = torch.tensor([c.truncated for _, c in rows], dtype=torch.float32)
    good = total[~total.isnan()]
    metrics |= logged.metrics()
    metrics.update(
        {
            "rollout/reward_mean": good.mean().item() if good.numel() else float("nan"),
            "rollout/reward_std": good.std().item() if good.numel() > 1 else 0.0,
            "rollout/nonfinite_rewards": float(total.isnan().sum()),
            "rollout/unscored": float((applied == 0).sum()),
            "length/mean": lengths.mean().item(),
            "length/max": lengths.max().item(),
            "length/truncated_frac": truncated.mean().item(),
        }
    )
    if (applied == 0).any():
        log.warning("%d completions had no reward that applies (every reward returned None): they total 0",
                    int((applied == 0).sum()))  # fmt: skip
    if not correct.isnan().all():
        metrics["rollout/accuracy"] = correct[~correct.isnan()].mean().item()
    return total, {k: (0.0 if math.isnan(v) else v) for k, v in metrics.items()}, correct, logged.columns


@dataclass
class Scores:
    """``score_completions``'s ``[B * G]`` totals, metrics, correctness and logged columns, and the seconds it took.

    A rollout sampled ahead keeps them, and so does its checkpoint (``loop/pending.py``): a resumed run trains on
    these rewards instead of asking a judge or a reward model again.
    """

    total: torch.Tensor
    metrics: dict[str, float]
    correct: torch.Tensor
    seconds: float
    extra: dict[str, list] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        rewards: list[Reward],
        prompts: list[Prompt],
        completions: list[list[Completion]],
        warn_s: float,
        state: RunState | None = None,
    ) -> Scores:
        """Score ``completions`` (``score_completions``, ``warn_s`` its ``reward_warn_s``) and time it."""
        start = time.perf_counter()
        total, metrics, correct, extra = score_completions(rewards, prompts, completions, warn_s, state)
        return cls(total, metrics, correct, time.perf_counter() - start, extra)
