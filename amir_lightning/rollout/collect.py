"""Collecting one rollout: sample G completions per prompt, score them, and turn them into groups with advantages.

``collect_rollout`` is a function of its inputs (prompts, an engine's ``generate``, rewards, settings): it knows
nothing of Lightning, so a script or a test calls it the way the data module does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.objectives.advantages import batch_std, group_advantages
from amir_lightning.rewards.base import Reward, RewardInputs, call_reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.batch import make_groups
from amir_lightning.rollout.engine import Completion
from amir_lightning.rollout.types import Rollout

log = logging.getLogger(__name__)


@dataclass
class RolloutSettings:
    """The shape of a rollout and of the optimisation steps it feeds (``data.rollout``).

    Attributes:
        group_size: ``G``, completions per prompt (>= 2).
        prompts_per_process: ``B``, prompts per rollout (one epoch) and process; the global batch is B x processes.
        micro_batch_groups: Groups per micro-batch (gradient accumulation splits a step into micro-batches).
        micro_batch_tokens: When set, replaces ``micro_batch_groups``: whole groups, sorted by length, as many per
            micro-batch as fit in this many padded tokens (rows x width; a larger group goes alone). Processes
            agree on the number of micro-batches of each step (the most any has), splitting their own further.
        steps_per_rollout: Optimisation steps per rollout, each on its share of the groups.
        passes: Passes over the rollout (PPO-style epochs, ``mu`` in GRPO papers); > 1 makes later steps
            off-policy (ratios and clipping act).
        advantage_scale: ``group``, ``batch`` or ``none`` (see ``group_advantages``).
        drop_zero_std_groups: Skip groups whose rewards are all equal (they carry no policy gradient).
        max_bad_rollouts: Stop after this many rollouts in a row with NaN or inf rewards.
        reward_warn_s: Say so when a reward has run this many seconds on a rollout, and again as often while it
            runs (a reward that hangs is not silent; ``FunctionReward.timeout_s`` stops the run instead).
        max_staleness: ``0``: every rollout is sampled from the weights it trains (generation, then training).
            ``1``: the next rollout is sampled while the policy trains on this one, from the weights this one
            started with, so each rollout trains one rollout's updates late (its ratios and clipping act, from the
            trainer's log-probs under the weights that sampled it). Needs an engine in its own process
            (``VLLMServerEngine``). The last rollout samples one more, never trained but kept in the last
            checkpoint, so a run resumed to train longer goes on exactly.
        stale_logps: With ``max_staleness`` 1, the old log-probs of a rollout sampled by older weights.
            ``current`` (default): the trainer's current weights, so the first step's ratio is 1 and no pass is
            added (decoupled PPO, arXiv 2110.00641); the staleness is then corrected by the engine/trainer importance
            weights (``model.loss.init_args.sampling_correction``, on by default), which weigh each token by the
            current policy's probability over the sampling engine's, truncated at ``sampling_cap`` (per token: a
            ``sequence_*`` weight, a product of hundreds of stale ratios, is warned about). ``sampler``:
            the trainer's under the weights that sampled it (kept until then): exact PPO ratios, for one more
            forward pass over the rollout. On the demo ``current`` learned as the synchronous loop did, and
            ``sampler`` less (held-out 0.879 against 0.829 over 3 seeds: docs/benchmarks.md).
    """

    group_size: int = 8
    prompts_per_process: int = 16
    micro_batch_groups: int = 2
    micro_batch_tokens: int | None = None
    steps_per_rollout: int = 1
    passes: int = 1
    advantage_scale: Literal["group", "batch", "none"] = "group"
    drop_zero_std_groups: bool = False
    max_bad_rollouts: int = 3
    reward_warn_s: float = 60.0
    max_staleness: int = 0
    stale_logps: Literal["sampler", "current"] = "current"

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "data.rollout.group_size", self.group_size, ge=2)
        for key in ("prompts_per_process", "micro_batch_groups", "steps_per_rollout", "passes", "max_bad_rollouts"):
            check_number(errors, f"data.rollout.{key}", getattr(self, key), ge=1)
        if self.micro_batch_tokens is not None:
            check_number(errors, "data.rollout.micro_batch_tokens", self.micro_batch_tokens, ge=1)
        check_number(errors, "data.rollout.reward_warn_s", self.reward_warn_s, gt=0)
        if self.max_staleness not in (0, 1):
            errors.append(f"data.rollout.max_staleness must be 0 or 1, got {self.max_staleness!r}")
        if self.stale_logps not in ("sampler", "current"):
            errors.append(f"data.rollout.stale_logps must be sampler or current, got {self.stale_logps!r}")
        if not errors and self.steps_per_rollout > self.prompts_per_process:
            errors.append(
                f"data.rollout.steps_per_rollout ({self.steps_per_rollout}) > data.rollout.prompts_per_process "
                f"({self.prompts_per_process}): every step needs at least one group"
            )
        raise_errors(errors)

    @property
    def off_policy(self) -> bool:
        """Whether a step can see a policy updated since the rollout (it then needs the sampling log-probs)."""
        return self.passes > 1 or self.steps_per_rollout > 1

    def uncorrected_staleness(self, sampling_correction: str | None) -> str | None:
        """A warning when the engine/trainer weights that carry a stale rollout's staleness are off or per sequence."""
        if not (self.max_staleness and self.stale_logps == "current"):
            return None
        fix = "Keep the correction per token (token_truncate, the default) or set data.rollout.stale_logps: sampler."
        if sampling_correction == "none":
            return (
                "data.rollout.stale_logps current with model.loss.init_args.sampling_correction none: each rollout, "
                f"sampled by weights one rollout older, trains with ratio 1 and nothing weighs its staleness. {fix}"
            )
        if str(sampling_correction).startswith("sequence"):
            return (
                f"data.rollout.stale_logps current and data.rollout.max_staleness {self.max_staleness} with "
                f"model.loss.init_args.sampling_correction {sampling_correction}: a completion's weight is the "
                "product of its token ratios, each stale by a rollout's updates; over hundreds of tokens it lands near "
                f"zero or at the cap (zero with sequence_mask) for most sequences. {fix}"
            )
        return None


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
    rewards: list[Reward], prompts: list[Prompt], completions: list[list[Completion]], warn_s: float = 60.0
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Total rewards ``[B * G]`` (groups contiguous), the rollout metrics, and correctness ``[B * G]``.

    Every reward sees the same ``RewardInputs`` (TRL's keyword arguments). A reward returning ``None`` for a
    completion does not apply to it: it adds nothing to its total and is left out of ``rollout/reward/<name>``
    (TRL's rule); a completion no reward applies to totals 0 and is counted in ``rollout/unscored``.

    Correctness (1.0 / 0.0) comes from the first ``MathAnswerReward``; it is NaN where that does not apply or when
    there is none, and the monitors then skip their correct/incorrect split.

    ``length/mean`` and ``length/max`` count the policy's own tokens (``Completion.policy_tokens``, what the loss
    trains on and the length-bias monitor measures); a tool's replies inside an episode are ``length/tool_tokens``.

    A NaN or inf score (a bug in a reward function) makes that completion's total NaN: its group gets zero
    advantage and no pairs, so it is never trained on, and ``rollout/nonfinite_rewards`` counts it (``RewardGuard``
    warns and stops after ``data.rollout.max_bad_rollouts`` such rollouts in a row).

    What a reward says of its call (``Reward.metrics``) is logged as ``<name>/<key>`` (``judge/unparsed_frac``).
    """
    rows = [(p, c) for p, group in zip(prompts, completions) for c in group]
    inputs = RewardInputs(
        [c.text for _, c in rows],
        [p for p, _ in rows],
        [c.token_ids for _, c in rows],
        [c.finish_reason for _, c in rows],
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
    return total, {k: (0.0 if math.isnan(v) else v) for k, v in metrics.items()}, correct


@dataclass
class Scores:
    """``score_completions``'s ``[B * G]`` totals, metrics and ``[B * G]`` correctness, and the seconds it took.

    A rollout sampled ahead keeps them, and so does its checkpoint (``rollout/pending.py``): a resumed run trains on
    these rewards instead of asking a judge or a reward model again.
    """

    total: torch.Tensor
    metrics: dict[str, float]
    correct: torch.Tensor
    seconds: float

    @classmethod
    def of(
        cls, rewards: list[Reward], prompts: list[Prompt], completions: list[list[Completion]], warn_s: float
    ) -> Scores:
        """Score ``completions`` (``score_completions``, ``warn_s`` its ``reward_warn_s``) and time it."""
        start = time.perf_counter()
        total, metrics, correct = score_completions(rewards, prompts, completions, warn_s)
        return cls(total, metrics, correct, time.perf_counter() - start)


def collect_rollout(
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    generate: Callable[[list[list[int]], int], list[list[Completion]]],
    rewards: list[Reward],
    settings: RolloutSettings,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scores: Scores | None = None,
) -> Rollout:
    """Sample ``settings.group_size`` completions per prompt, score them, and group them with their advantages.

    Args:
        prompts: This process's prompts.
        prompt_ids: Their chat-templated token ids.
        generate: ``(prompt ids, n) -> n completions per prompt`` (the engine, seeded and with its sampling).
        rewards: Summed with their weights.
        settings: Group size and advantage scaling.
        sum_over_processes: Sums a tensor over processes; ``advantage_scale: batch`` needs it for the global std.
        scores: The completions' scores when they were scored already (a rollout sampled ahead); the rewards are
            then not called.

    Returns:
        The rollout: its groups with their advantages, and its metrics.
    """
    start = time.perf_counter()
    completions = generate(prompt_ids, settings.group_size)
    generate_s = time.perf_counter() - start
    scores = scores or Scores.of(rewards, prompts, completions, settings.reward_warn_s)
    total, metrics, correct, score_s = scores.total, dict(scores.metrics), scores.correct, scores.seconds
    std = batch_std(total, sum_over_processes) if settings.advantage_scale == "batch" else None
    # A group with a non-finite reward carries no signal (zero advantage, no pairs): see score_completions.
    advantages = group_advantages(total, settings.group_size, settings.advantage_scale, std=std).nan_to_num(nan=0.0)
    groups = make_groups(prompts, prompt_ids, completions, total, advantages, correct)
    tokens = sum(c.policy_tokens for group in completions for c in group)  # sampled (a tool's replies are not)
    episodes = [c for group in completions for c in group if c.loss_mask is not None]
    if episodes:  # multi-turn (data.environment): how much the policy used its tool
        metrics["rollout/tool_calls"] = sum(c.tool_calls for c in episodes) / len(episodes)
        metrics["rollout/tool_call_frac"] = sum(c.tool_calls > 0 for c in episodes) / len(episodes)
        metrics["length/tool_tokens"] = sum(len(c.token_ids) - c.policy_tokens for c in episodes) / len(episodes)
    rollout = Rollout(groups, metrics, {"generate_s": generate_s, "score_s": score_s}, tokens)
    zero_std = rollout.zero_std
    metrics.update(
        {
            "rollout/zero_std_frac": sum(zero_std) / len(groups),
            "rollout/tokens_per_s": tokens / max(generate_s, 1e-9),
            "rollout/generate_s": generate_s,
            "rollout/score_s": score_s,
            "rollout/groups_kept": float(len(rollout.trained_groups(settings.drop_zero_std_groups))),
        }
    )
    return rollout
