"""Making one rollout: score the G completions of each prompt and turn them into groups with their advantages.

``make_rollout`` is a function of its inputs (prompts, their completions, rewards, settings): it knows nothing of
engines or Lightning, so a script or a test calls it the way the schedules of ``loop/schedule.py`` do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.environments.replies import tool_metrics
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.loop.batch import make_groups
from amir_lightning.loop.rewarding import Scores
from amir_lightning.loop.types import Rollout
from amir_lightning.objectives.advantages import ESTIMATORS, estimate_advantages
from amir_lightning.rewards.base import Reward

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
        advantage_estimator: How rewards become advantages (``objectives/advantages.py``): ``grpo`` (the group's
            mean subtracted), ``rloo`` (the mean of the group's others subtracted, TRL's RLOO), ``reinforce_pp``
            (standardised over the global batch's tokens, REINFORCE++) or ``reinforce_pp_baseline`` (the group's
            mean subtracted, then standardised so).
        advantage_scale: For ``grpo`` and ``rloo``: ``group``, ``batch`` or ``none`` (see ``group_advantages``);
            ``None``: ``group`` for ``grpo``, ``none`` for ``rloo`` (as TRL's trainers). The REINFORCE++ estimators
            standardise themselves and refuse it.
        drop_zero_std_groups: Skip groups whose rewards are all equal (they carry no policy gradient).
        dynamic_sampling: Drop those groups and sample more prompts until this process has ``prompts_per_process``
            groups with reward variance or ``max_sampling_rounds`` rounds ran (DAPO's dynamic sampling, arXiv
            2503.14476; ``loop/dynamic.py``). Each further round draws the missing groups' worth of prompts at
            the share with variance seen so far, and samples them from the weights the rollout trains: with
            ``max_staleness`` 0 those of its first round; ahead, the newer ones (its first round is stale, the
            further rounds are not), with ``stale_logps current``.
        max_sampling_rounds: Rounds of sampling per rollout with ``dynamic_sampling``, the first included; when they
            run out the step trains the groups with variance it has (``rollout/sampling_rounds``,
            ``rollout/kept_group_frac``).
        max_bad_rollouts: Stop after this many rollouts in a row with NaN or inf rewards.
        reward_warn_s: Say so when a reward has run this many seconds on a rollout, and again as often while it
            runs (a reward that hangs is not silent; ``FunctionReward.timeout_s`` stops the run instead).
        max_staleness: ``0``: every rollout is sampled from the weights it trains (generation, then training).
            ``1``: the next rollout is sampled while the policy trains on this one, from the weights this one
            started with, so each rollout trains one rollout's updates late (its ratios and clipping act, from the
            trainer's log-probs under the weights that sampled it). ``N`` > 1 (with ``partial_rollouts``): N
            rollouts sample while the policy trains, the oldest N rollouts' updates late at most. Needs an engine
            in its own process (``VLLMServerEngine``). The last rollout samples N more, never trained but kept in
            the last checkpoint, so a run resumed to train longer goes on exactly.
        partial_rollouts: With ``max_staleness`` >= 1, a push does not wait for the rollouts sampling ahead: they
            go on with the new weights (in-flight weight updates), and each token says which weights sampled it
            (``rollout/staleness_steps``, ``rollout/staleness_steps_max``, over tokens; ``rollout/spanning_frac``:
            completions sampled across a push). Their sampling log-probs are the engine's, token by token, which the
            engine / trainer importance weights use (``stale_logps: current``). A checkpoint waits for the rollouts
            sampling ahead to finish on the weights they have, and keeps them whole: checkpoint every few rollouts
            (``checkpoint.every_n_epochs``) to keep the overlap; which tokens a push catches depends on timing, so
            two such runs differ (the exact resume holds from a checkpoint, for the rollouts it kept).
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
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    advantage_scale: Literal["group", "batch", "none"] | None = None
    drop_zero_std_groups: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    max_bad_rollouts: int = 3
    reward_warn_s: float = 60.0
    max_staleness: int = 0
    partial_rollouts: bool = False
    stale_logps: Literal["sampler", "current"] = "current"

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "data.rollout.group_size", self.group_size, ge=2)
        for key in ("prompts_per_process", "micro_batch_groups", "steps_per_rollout", "passes", "max_bad_rollouts",
                    "max_sampling_rounds"):  # fmt: skip
            check_number(errors, f"data.rollout.{key}", getattr(self, key), ge=1)
        if self.micro_batch_tokens is not None:
            check_number(errors, "data.rollout.micro_batch_tokens", self.micro_batch_tokens, ge=1)
        check_number(errors, "data.rollout.reward_warn_s", self.reward_warn_s, gt=0)
        check_number(errors, "data.rollout.max_staleness", self.max_staleness, ge=0)
        if not errors and self.max_staleness > 1 and not self.partial_rollouts:
            errors.append(
                f"data.rollout.max_staleness {self.max_staleness} needs data.rollout.partial_rollouts true: without it "
                "each push waits for the rollouts sampling ahead, so more than one ahead trains later, not faster"
            )
        if self.partial_rollouts and not self.max_staleness:
            errors.append("data.rollout.partial_rollouts needs data.rollout.max_staleness >= 1 (rollouts sampling "
                          "while the policy trains, which a push can update)")  # fmt: skip
        if self.partial_rollouts and self.stale_logps == "sampler":
            errors.append(
                "data.rollout.partial_rollouts needs data.rollout.stale_logps current: a completion sampled across "
                "pushes has no one set of weights that sampled it (the engine's per-token log-probs weigh it)"
            )
        if self.advantage_estimator not in ESTIMATORS:
            errors.append(f"data.rollout.advantage_estimator must be one of {', '.join(ESTIMATORS)}, got "
                          f"{self.advantage_estimator!r}")  # fmt: skip
        elif self.advantage_estimator.startswith("reinforce_pp") and self.advantage_scale is not None:
            errors.append(f"data.rollout.advantage_scale does not apply to advantage_estimator "
                          f"{self.advantage_estimator}: it standardises over the batch's tokens itself; leave "
                          "advantage_scale out")  # fmt: skip
        if self.advantage_scale not in (None, "group", "batch", "none"):
            errors.append(f"data.rollout.advantage_scale must be group, batch or none, got {self.advantage_scale!r}")
        if self.stale_logps not in ("sampler", "current"):
            errors.append(f"data.rollout.stale_logps must be sampler or current, got {self.stale_logps!r}")
        if self.dynamic_sampling and self.max_staleness and self.stale_logps == "sampler":
            errors.append(
                "data.rollout.dynamic_sampling with data.rollout.max_staleness needs data.rollout.stale_logps current: "
                "a rollout's further rounds are sampled by the weights it trains, not by those that sampled its first "
                "round, so no one set of old weights scores them all"
            )
        if not errors and self.steps_per_rollout > self.prompts_per_process:
            errors.append(
                f"data.rollout.steps_per_rollout ({self.steps_per_rollout}) > data.rollout.prompts_per_process "
                f"({self.prompts_per_process}): every step needs at least one group"
            )
        raise_errors(errors)

    @property
    def scale(self) -> str:
        """How ``grpo`` and ``rloo`` scale their advantages: ``advantage_scale``, or the estimator's default."""
        if self.advantage_scale is not None:
            return self.advantage_scale
        return "none" if self.advantage_estimator == "rloo" else "group"

    @property
    def drops_zero_std(self) -> bool:
        """Whether steps leave out the groups whose rewards are all equal."""
        return self.drop_zero_std_groups or self.dynamic_sampling

    @property
    def off_policy(self) -> bool:
        """Whether a step can see a policy updated since the rollout (it then needs the sampling log-probs)."""
        return self.passes > 1 or self.steps_per_rollout > 1

    def length_errors(self, rollouts: int | None) -> list[str]:
        """What cannot work in a run of ``rollouts`` rollouts (``None``: no set length).

        ``max_staleness`` rollouts start sampling at once after the first: more than the run has would sample
        rollouts that no epoch trains (1000 ahead on a 2-rollout run sent 128,000 sequences at once).
        """
        if rollouts is None or self.max_staleness <= max(rollouts, 1):
            return []
        return [
            f"data.rollout.max_staleness {self.max_staleness} is more than the run's {rollouts} rollouts "
            f"(trainer.max_epochs): {self.max_staleness} rollouts would sample at once after the first, and at most "
            f"{max(rollouts - 1, 0)} of them are trained; set it to {max(rollouts, 1)} or less"
        ]

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


def make_rollout(
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    generate_s: float,
    rewards: list[Reward],
    settings: RolloutSettings,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scores: Scores | None = None,
    *,
    more_seconds: dict[str, float] | None = None,
    more_metrics: dict[str, float] | None = None,
    old_weights: dict[str, torch.Tensor] | None = None,
) -> Rollout:
    """Score the completions of each prompt and group them with their advantages.

    Args:
        prompts: This process's prompts.
        prompt_ids: Their chat-templated token ids.
        completions: ``settings.group_size`` completions of each prompt, as the engine sampled them.
        generate_s: How long sampling them took (``rollout/generate_s``, ``rollout/tokens_per_s``).
        rewards: Summed with their weights.
        settings: Group size and advantage scaling.
        sum_over_processes: Sums a tensor over processes; ``advantage_scale: batch`` needs it for the global std.
        scores: The completions' scores when they were scored already (a rollout sampled ahead); the rewards are
            then not called.
        more_seconds: The loop's own seconds (``sync_s``, ``wait_s``), beside ``generate_s`` and ``score_s``.
        more_metrics: The loop's own metrics (the sync's, dynamic sampling's, staleness), logged over these.
        old_weights: ``Rollout.old_weights``.

    Returns:
        The rollout: its groups with their advantages, and its metrics.
    """
    scores = scores or Scores.of(rewards, prompts, completions, settings.reward_warn_s)
    total, metrics, correct, score_s = scores.total, dict(scores.metrics), scores.correct, scores.seconds
    # A group with a non-finite reward carries no signal (zero advantage, no pairs): see loop/rewarding.py.
    trained = torch.tensor([c.policy_tokens for group in completions for c in group], dtype=torch.float64)  # [N]
    advantages = estimate_advantages(total, settings.group_size, settings.advantage_estimator, settings.scale, trained,
                                     sum_over_processes).nan_to_num(nan=0.0)  # fmt: skip
    groups = make_groups(prompts, prompt_ids, completions, total, advantages, correct, scores.extra)
    tokens = int(trained.sum())  # sampled (a tool's replies are not)
    metrics |= tool_metrics([c for group in completions for c in group])  # multi-turn: how the tool was used
    seconds = {"generate_s": generate_s, "score_s": score_s} | (more_seconds or {})
    rollout = Rollout(groups, metrics, seconds, tokens, old_weights)
    zero_std = rollout.zero_std
    metrics.update(
        {
            "rollout/zero_std_frac": sum(zero_std) / len(groups),
            "rollout/tokens_per_s": tokens / max(generate_s, 1e-9),
            "rollout/generate_s": generate_s,
            "rollout/score_s": score_s,
            "rollout/groups_kept": float(len(rollout.trained_groups(settings.drops_zero_std))),
        }
        | (more_metrics or {})
    )
    return rollout
