"""RolloutDataModule: one epoch is one rollout, from weight sync to the optimisation steps it feeds.

Each epoch takes its rollout from the schedule (``loop/schedule.py``: the weights pushed, G completions for each
of the next B prompts sampled, scored and grouped with their advantages, in turn or while the epoch before trained)
and yields one ``RolloutStep`` per optimisation step.

The weight sync sits at the top of ``train_dataloader()``: Lightning reloads the dataloader *before*
``on_train_epoch_start``, so a callback there would generate with stale weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch
from lightning import LightningDataModule
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader
from typing_extensions import override

from amir_lightning.data.base import PromptSource
from amir_lightning.data.feed import PromptFeed
from amir_lightning.data.templates import ChatFormat, read_template
from amir_lightning.engines.base import RolloutEngine, SamplingConfig
from amir_lightning.environments.base import Environment
from amir_lightning.environments.tools import ToolEnvironment
from amir_lightning.evaluation.evaluator import EvaluationSettings, Evaluator
from amir_lightning.helpers.distributed import mean_over_processes
from amir_lightning.helpers.tracking import log_metrics
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.loop.batch import agree_on_plan, build_steps, plan_steps, score_old
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.loop.rewarding import RewardGuard
from amir_lightning.loop.sampler import Sampler, setting_errors
from amir_lightning.loop.schedule import Ahead, At, InTurn, Schedule
from amir_lightning.loop.sync import SyncCheck, SyncSettings
from amir_lightning.models.policy import Policy
from amir_lightning.rewards.base import FunctionReward, Reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.systems.progress import rollout_line, short_rollout_line, where_it_stopped
from amir_lightning.systems.summary import run_rollouts, run_steps

log = logging.getLogger(__name__)


def _identity(batch):
    return batch


class RolloutDataModule(LightningDataModule):
    """On-policy rollouts from a prompt source through a rollout engine, scored by rewards.

    Args:
        prompts: Training prompt source.
        engine: Rollout engine (``VLLMEngine`` or ``HFEngine``).
        rewards: Rewards summed with their weights: ``Reward`` classes, or dotted paths to plain functions with TRL's
            signature (``FunctionReward``); default a ``MathAnswerReward``.
        rollout: Group size, prompts per rollout, micro-batches, steps and passes per rollout, advantage scaling.
        sampling: Sampling settings for training rollouts.
        system_prompt: System message prepended to every prompt (e.g. ``THINK_ANSWER_SYSTEM_PROMPT``).
        chat_template: A Jinja chat template, or the path of a file holding one, used instead of the tokenizer's
            (training, evaluation and the sync probe). The exported policy keeps its own.
        chat_template_kwargs: Variables the chat template reads, e.g. ``{enable_thinking: false}`` for Qwen3.
        example_turns: Chat messages shown before every prompt's own, after the system prompt: a worked example, such
            as a question, an assistant turn with ``tool_calls``, a ``tool`` result and the answer
            (``configs/demo_tools.yaml``).
        shuffle: Shuffle a finite prompt source once per pass over it; start a random one (``is_random``, e.g.
            ``ArithmeticPrompts``) at a seed-dependent index. Off: every seed trains on the same prompt sequence.
        max_prompt_tokens: Longest allowed prompt after the chat template (and at most the engine's
            ``max_model_len`` minus ``data.sampling.max_new_tokens``).
        bad_prompts: What to do with training prompts that cannot be used, found when the data is opened (every
            prompt of a finite source is rendered once, before the engine starts): over that length, not encodable
            by the tokenizer (a lone surrogate from a JSON escape), or with an empty user message. ``skip`` them
            (counted, the first few named, ``data/skipped_prompts``) or stop with an ``error`` naming the first
            (file and line, or dataset index).
        environment: Multi-turn rollouts (``environments/base.py``): what the policy's tool calls go to, e.g.
            ``ToolEnvironment`` or ``CalculatorEnvironment``; its replies are written into the completion and masked
            out of the loss. ``None``: single-turn completions.
        tools: Shorthand for ``environment: ToolEnvironment`` with these tools (``module.function`` paths of typed,
            documented functions), called as the chat template writes calls and read by vLLM's ``hermes`` parser
            (``environments/tools.py``).
        sync: How the weight sync is verified (``loop/sync.py``): the engine's weights against the pushed ones,
            exactly, and the probe log-probs.
        val_prompts: Held-out prompts for ``validate`` and validation during ``fit``.
        benchmarks: Benchmarks for ``amir test`` (``BenchmarkPrompts``); default: the held-out prompts.
        evaluation: Sizes, samples, sampling and pass@k of validation and ``amir test``.
        seed: Seed of the prompt order (with ``shuffle``) and of the engine.
    """

    def __init__(
        self,
        prompts: PromptSource,
        engine: RolloutEngine,
        rewards: list[Reward | str] | None = None,
        rollout: RolloutSettings = RolloutSettings(),  # noqa: B008 (configs are never mutated)
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008
        system_prompt: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        example_turns: list[dict[str, Any]] | None = None,
        shuffle: bool = True,
        max_prompt_tokens: int = 512,
        bad_prompts: Literal["skip", "error"] = "skip",
        environment: Environment | None = None,
        tools: list[str] | None = None,
        sync: SyncSettings = SyncSettings(),  # noqa: B008
        val_prompts: PromptSource | None = None,
        benchmarks: list[PromptSource] | None = None,
        evaluation: EvaluationSettings = EvaluationSettings(),  # noqa: B008
        seed: int = 0,
    ) -> None:
        super().__init__()
        errors: list[str] = []
        check_number(errors, "data.max_prompt_tokens", max_prompt_tokens, ge=1)
        if bad_prompts not in ("skip", "error"):
            errors.append(f"data.bad_prompts must be skip or error, got {bad_prompts!r}")
        if tools and environment is not None:
            errors.append("data.tools and data.environment are both given: tools are a ToolEnvironment; give its "
                          "tools in data.environment.init_args.tools")  # fmt: skip
        environment = ToolEnvironment(tools) if tools and environment is None else environment
        raise_errors(errors + setting_errors(engine, rollout, sampling, environment))
        if warning := sampling.mismatch_warning():  # top-p/k, min-p: the weight is the kept mass Z <= 1
            log.warning(warning)
        self.prompts, self.engine = prompts, engine
        self.rewards = [r if isinstance(r, Reward) else FunctionReward(r) for r in rewards or [MathAnswerReward()]]
        self.settings, self.sampling = rollout, sampling
        tool_schemas = environment.tool_schemas() if environment is not None else None
        template, template_kwargs = read_template(chat_template), dict(chat_template_kwargs or {})
        self.chat = ChatFormat(system_prompt, template, template_kwargs, tool_schemas, example_turns)
        self.max_prompt_tokens = max_prompt_tokens
        room = getattr(engine, "max_model_len", None)  # a prompt and its completion must fit the engine's context
        self.prompt_limit = min(max_prompt_tokens, room - sampling.max_new_tokens) if room else max_prompt_tokens
        self._rollout_times: list[float] = []  # when each rollout of this process's run was logged
        self.sampler = Sampler(engine, environment, SyncCheck(sync), self.settings.partial_rollouts)
        self.val_prompts, self.benchmarks = val_prompts, list(benchmarks or [])
        self.evaluation = evaluation.with_length_limit(sampling.max_new_tokens)
        self.seed, self.feed = seed, PromptFeed(prompts, self.chat, self.prompt_limit, bad_prompts, shuffle, seed)
        self.reward_guard = RewardGuard(rollout.max_bad_rollouts)
        self._eval_grader: MathAnswerReward | None = None
        self.policy: Policy | None = None  # handed over by the module (attach)
        self.schedule: Schedule | None = None  # built at set-up, with the settings and rewards as they are then

    def attach(self, policy: Policy) -> None:
        """Take the trained policy: its tokenizer, its files for the engine, its weights and its scoring.

        ``amir`` attaches the module's (``AmirGRPOModule.policy``) before the trainer runs; a script that builds the
        trainer itself calls ``data.attach(module.policy)``.
        """
        self.policy = policy

    def at(self) -> At:
        """Where the run stands: Lightning's counters, read here and passed down."""
        trainer = self.trainer
        step, rank, ranks = trainer.global_step, trainer.global_rank, trainer.world_size
        return At(trainer.current_epoch, step, rank, ranks, trainer.strategy.root_device, run_steps(trainer))

    @property
    def tokenizer(self):
        """The policy's tokenizer (prompts, padding, the sync probe)."""
        return self.policy.tokenizer

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, stage: str) -> None:
        if stage == "fit" and self.trainer.reload_dataloaders_every_n_epochs != 1:
            raise ValueError(
                "trainer.reload_dataloaders_every_n_epochs must be 1: every epoch is a fresh rollout "
                f"(got {self.trainer.reload_dataloaders_every_n_epochs})"
            )
        if self.policy is None:
            raise RuntimeError(
                "RolloutDataModule has no policy: call data.attach(module.policy) before the trainer runs (amir does)"
            )
        self.chat.check(self.tokenizer)
        if self.sampler.environment is not None:  # the template's tool messages and the turns' parser, read once
            self.sampler.environment.prepare(self.tokenizer, self.chat)
        if self.schedule is None:
            kind = Ahead if self.settings.max_staleness else InTurn  # sampled while the epoch before trains, or after
            args = self.feed, self.sampler, self.policy, self.rewards, self.settings, self.sampling, self.seed
            self.schedule = kind(*args)
        if stage == "fit":
            raise_errors(self.settings.length_errors(run_rollouts(self.trainer)))
            grading = next((r for r in self.rewards if r.needs_reference), None)
            if skipped := self.feed.screen(self.tokenizer, grading, self.trainer.is_global_zero):
                log_metrics(self.trainer, {"data/skipped_prompts": skipped})
            for reward in self.rewards:  # a judge's server starts here, not after the first generation
                reward.fit_to_sampling(self.sampling.max_new_tokens)
                reward.setup()
        for source, count in self.evaluation.prompt_sets(stage, self.benchmarks, self.val_prompts):
            # one over the limit is an error naming it: leaving it out would change what evaluation measures
            self.feed.tokenize(self.tokenizer, [source[i] for i in range(count)], source.describe())
        trainer, samplings = self.trainer, (self.sampling, self.evaluation.val_sampling, self.evaluation.sampling)
        seed, device = self.seed + trainer.global_rank, trainer.strategy.root_device
        self.sampler.start(self.policy, seed, device, trainer.local_rank, samplings)

    @override
    def state_dict(self) -> dict:
        """The schedule's record (the prompt stream's position, the rollout the run is in) and the sync's probe.

        With ``max_staleness`` N it holds every process's N rollouts sampled ahead, scored (``loop/saved.py``).
        """
        return self.schedule.state_dict() | {"sync": self.sampler.sync_check.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.schedule.load_state_dict(state_dict, self.at())
        self.sampler.sync_check.load_state_dict(state_dict.get("sync", {}))

    @override
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Count the steps of this rollout that have started (the schedule's record for ``state_dict``)."""
        if self.trainer.training:
            self.schedule.step_started()
        return batch

    def on_exception(self, exception: BaseException) -> None:
        """Say where a SIGTERM stopped the run and where it resumes from (``amir`` prints it as it exits)."""
        if isinstance(exception, SIGTERMException):
            exception.amir_where = where_it_stopped(self.trainer)  # type: ignore[attr-defined]

    @override
    def teardown(self, stage: str) -> None:
        for reward in [*self.rewards, self._eval_grader]:
            if reward is not None:
                reward.close()
        if self.sampler.environment is not None:
            self.sampler.environment.close()  # its servers and threads (a verifiers environment's)

    # ------------------------------------------------------------------ loaders
    @override
    def train_dataloader(self) -> DataLoader:
        """This epoch's rollout as the optimisation steps it feeds (``RolloutStep``), in order."""
        at, settings = self.at(), self.settings
        if done := self.schedule.steps_done(at.epoch):
            # Resuming from a checkpoint written inside this epoch, after its rollout's steps started (at its end,
            # or after its validation): Lightning reloads only to see that the epoch's batches are done and skips
            # them. A new rollout would be wasted and skip prompts, so it gets placeholders it never reads (a
            # checkpoint taken in the middle of a rollout resumes at the next rollout).
            return DataLoader([None] * done, batch_size=None, collate_fn=_identity)
        rollout = self.schedule.next_rollout(at)  # pushed, sampled, scored, with its advantages
        self.reward_guard.check(rollout.metrics)  # a run of rollouts with non-finite rewards stops here
        self._log(rollout.metrics, at)
        groups = rollout.trained_groups(settings.drops_zero_std)
        plan = plan_steps(groups, settings.steps_per_rollout, settings.micro_batch_groups, settings.micro_batch_tokens)
        plan = agree_on_plan(plan, settings.steps_per_rollout, at.max_over_processes)  # the same steps everywhere
        self._log_short(at, len(groups), sum(bool(parts) for parts in plan))
        steps = build_steps(plan, self.policy.pad_token_id, settings.passes, filler=rollout.groups[0], rollout=rollout)
        if len(steps) > 1 or rollout.old_weights:  # a step after an update, or a stale rollout: ratios need old logps
            batches = {id(b): b for step in steps for b in step.micro_batches}.values()  # a pass repeats batches
            score_old(self.policy, list(batches), rollout.old_weights)  # the trainer's numerics (the engine's differ)
        return DataLoader(steps, batch_size=None, collate_fn=_identity)

    @override
    def val_dataloader(self) -> DataLoader | list:
        evaluator = self.evaluator()
        batches = evaluator.validation_batches(self.val_prompts)
        log_metrics(self.trainer, evaluator.sync_metrics)
        return DataLoader(batches, batch_size=None, collate_fn=_identity) if batches else []

    @override
    def test_dataloader(self) -> DataLoader:
        """``amir test``: every benchmark of ``benchmarks`` (else the held-out prompts), one batch each."""
        evaluator = self.evaluator()
        batches = evaluator.test_batches(self.benchmarks, self.val_prompts)
        log_metrics(self.trainer, evaluator.sync_metrics)
        return DataLoader(batches, batch_size=None, collate_fn=_identity)

    def evaluator(self) -> Evaluator:
        """Evaluation through the training schedule, graded by the first ``MathAnswerReward`` of the rewards."""
        grader = next((r for r in self.rewards if isinstance(r, MathAnswerReward)), None)
        if grader is None:  # none among the rewards: one of evaluation's own, closed at teardown
            self._eval_grader = grader = self._eval_grader or MathAnswerReward()
        progress = self.trainer.is_global_zero and self.trainer.progress_bar_callback is not None
        return Evaluator(self.evaluation, self.schedule, self.at(), grader, progress)

    # ------------------------------------------------------------------ logging
    def _log_short(self, at: At, groups: int, steps: int) -> None:
        """Log how many of this rollout's steps train on groups, and say so when they are fewer than planned.

        Every process must call it (the groups are counted over processes).
        """
        settings = self.settings
        log_metrics(self.trainer, {"train/steps_in_rollout": float(steps * settings.passes)})
        total = int(at.sum_over_processes(torch.tensor([float(groups)]))[0])
        if at.rank == 0 and (line := short_rollout_line(at.epoch, total, steps, settings)):
            log.warning("%s", line)

    def _log(self, metrics: dict[str, float], at: At) -> None:
        """Log rollout metrics averaged over processes, and the rollout's line; every process must call it."""
        reduced = mean_over_processes(metrics, at.device)  # a reward's log_metric may reach some processes only
        log_metrics(self.trainer, reduced)
        self._rollout_times.append(time.perf_counter())
        if at.rank == 0:
            log.info("%s", rollout_line(reduced, at.epoch, self.trainer.max_epochs, self._rollout_times))
