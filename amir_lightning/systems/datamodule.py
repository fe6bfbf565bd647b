"""RolloutDataModule: one epoch is one rollout, from weight sync to the optimisation steps it feeds.

Each epoch syncs the policy into the engine, collects a rollout (``rollout/collect.py``: G completions for each
of the next B prompts, scored, grouped with their advantages) and yields one ``RolloutStep`` per optimisation step.

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

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.data.feed import PromptFeed
from amir_lightning.data.templates import ChatFormat, read_template, render_prompts
from amir_lightning.evaluation.evaluator import EvaluationSettings, Evaluator
from amir_lightning.helpers.distributed import all_reduce
from amir_lightning.helpers.tracking import log_metrics
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rewards.base import FunctionReward, Reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.batch import agree_on_plan, build_steps, plan_steps
from amir_lightning.rollout.collect import RolloutSettings, collect_rollout
from amir_lightning.rollout.engine import Completion, RolloutEngine, SamplingConfig
from amir_lightning.rollout.episodes import Environment
from amir_lightning.rollout.pending import PendingRollout, SavedRollout
from amir_lightning.rollout.policy import Policy
from amir_lightning.rollout.rewarding import RewardGuard
from amir_lightning.rollout.sampler import AHEAD, TRAIN, Sampler, generation_seed
from amir_lightning.rollout.saved import gather_saved, restore, saved_for_rank
from amir_lightning.rollout.sync import SyncCheck, SyncSettings
from amir_lightning.rollout.types import Rollout
from amir_lightning.systems.progress import time_left

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
        shuffle: Shuffle a finite prompt source once per pass over it; start a random one (``is_random``, e.g.
            ``ArithmeticPrompts``) at a seed-dependent index. Off: every seed trains on the same prompt sequence.
        max_prompt_tokens: Longest allowed prompt after the chat template (and at most the engine's
            ``max_model_len`` minus ``data.sampling.max_new_tokens``).
        bad_prompts: What to do with training prompts that cannot be used, found when the data is opened (every
            prompt of a finite source is rendered once, before the engine starts): over that length, not encodable
            by the tokenizer (a lone surrogate from a JSON escape), or with an empty user message. ``skip`` them
            (counted, the first few named, ``data/skipped_prompts``) or stop with an ``error`` naming the first
            (file and line, or dataset index).
        environment: Multi-turn rollouts (``rollout/episodes.py``): what the policy's tool calls go to, e.g.
            ``CalculatorEnvironment``; its replies are written into the completion and masked out of the loss.
            ``None``: single-turn completions.
        sync: How the weight sync is verified (``rollout/sync.py``): the engine's weights against the pushed ones,
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
        shuffle: bool = True,
        max_prompt_tokens: int = 512,
        bad_prompts: Literal["skip", "error"] = "skip",
        environment: Environment | None = None,
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
        room = getattr(engine, "max_model_len", None)
        if room is not None and room - sampling.max_new_tokens < 1:
            errors.append(
                f"data.sampling.max_new_tokens ({sampling.max_new_tokens}) leaves no room for a prompt in "
                f"data.engine.init_args.max_model_len ({room})"
            )
        if rollout.max_staleness and not engine.runs_apart:
            errors.append(
                f"data.rollout.max_staleness {rollout.max_staleness} needs an engine in its own process "
                f"(amir_lightning.rollout.VLLMServerEngine): {type(engine).__name__} generates inside the training "
                "process, so generation and training cannot overlap"
            )
        raise_errors(errors)
        if warning := sampling.mismatch_warning():  # top-p/k, min-p: the weight is the kept mass Z <= 1
            log.warning(warning)
        self.prompts, self.engine = prompts, engine
        self.rewards = [r if isinstance(r, Reward) else FunctionReward(r) for r in rewards or [MathAnswerReward()]]
        self.settings, self.sampling = rollout, sampling
        self.chat = ChatFormat(system_prompt, read_template(chat_template), dict(chat_template_kwargs or {}))
        self.max_prompt_tokens = max_prompt_tokens
        # a prompt and its completion must fit the engine's context
        self.prompt_limit = min(max_prompt_tokens, room - sampling.max_new_tokens) if room else max_prompt_tokens
        # Where this process is in the run, the data module's own record (state_dict): the epoch of the rollout
        # last drawn, the stream position before that draw, and how many of its steps have started.
        self._rollout_epoch: int | None = None
        self._drawn_at: int | None = None
        self._steps_started = 0
        self._rollout_times: list[float] = []  # when each rollout of this process's run was logged
        self.sampler = Sampler(engine, environment, SyncCheck(sync))
        self.val_prompts, self.benchmarks = val_prompts, list(benchmarks or [])
        self.evaluation = evaluation.with_length_limit(sampling.max_new_tokens)
        self.seed, self.feed = seed, PromptFeed(prompts, self.chat, self.prompt_limit, bad_prompts, shuffle, seed)
        self.reward_guard = RewardGuard(rollout.max_bad_rollouts)
        self._eval_grader: MathAnswerReward | None = None
        self.policy: Policy | None = None  # handed over by the module (attach)
        # max_staleness 1: the rollout being trained, the one sampling meanwhile, and one a checkpoint brought back
        self._current: PendingRollout | None = None
        self._pending: PendingRollout | None = None
        self._saved: SavedRollout | None = None

    def attach(self, policy: Policy) -> None:
        """Take the trained policy: its tokenizer, its files for the engine, its weights and its scoring.

        ``amir`` attaches the module's (``AmirGRPOModule.handle``) before the trainer runs; a script that builds the
        trainer itself calls ``data.attach(module.handle)``.
        """
        self.policy = policy

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
                "RolloutDataModule has no policy: call data.attach(module.handle) before the trainer runs (amir does)"
            )
        self.chat.check(self.tokenizer)
        if stage == "fit":
            grading = next((r for r in self.rewards if r.needs_reference), None)
            if skipped := self.feed.screen(self.tokenizer, grading, self.trainer.is_global_zero):
                log_metrics(self.trainer, {"data/skipped_prompts": skipped})
            for reward in self.rewards:  # a judge's server starts here, not after the first generation
                reward.setup()
        self.screen_evaluation_prompts(stage)
        if not self.engine.started:
            trainer = self.trainer
            seed, device = self.seed + trainer.global_rank, trainer.strategy.root_device
            self.engine.start(self.policy.model_dir, seed=seed, device=device, local_rank=trainer.local_rank)
        for sampling in (self.sampling, self.evaluation.val_sampling, self.evaluation.sampling):
            self.engine.check_sampling(sampling)

    def state_dict(self) -> dict:
        """The prompt stream's position, the sync check's probe, and the rollout the run is in.

        A checkpoint written after this rollout's prompts were drawn but before any of its steps started (SLURM's
        requeue checkpoint, saved whenever the signal comes, often mid-generation) holds the position before the
        draw: its resume, which runs the rollout again, draws the same prompts, as an uninterrupted run does.
        With ``max_staleness`` 1 it holds every process's rollout sampled ahead, scored (``rollout/saved.py``).
        """
        drawn_only = self._drawn_at is not None and not self._steps_started
        cursor = self._drawn_at if drawn_only else self.feed.position
        rollout = {"epoch": self._rollout_epoch, "steps_started": self._steps_started}
        state = {"cursor": cursor, "sync": self.sampler.sync_check.state_dict(), "rollout": rollout}
        ahead, cursor = self._rollout_ahead()
        if ahead is not None and ahead is self._pending:  # scored now: this run and a resumed one train these scores
            ahead.score(self.rewards, self.settings.reward_warn_s)
        if self.settings.max_staleness:  # waits for its sampling to finish
            state["pending"] = gather_saved(ahead.state() if ahead else None, not self.policy.sharded)
        if cursor is not None:
            state["cursor"] = cursor
        return state

    def _rollout_ahead(self) -> tuple[PendingRollout | SavedRollout | None, int | None]:
        """With ``max_staleness`` 1: the rollout a resumed run trains next, and the stream position it resumes at.

        After this rollout's steps started, that is the one sampling meanwhile; before, this one, which then runs
        again, drawing its successor again from where it was drawn.
        """
        if self._current is not None and not self._steps_started:
            return self._current, self._pending.drawn_at if self._pending is not None else self.feed.position
        return self._pending or self._saved, None

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.feed.position = int(state_dict["cursor"])
        self.sampler.sync_check.load_state_dict(state_dict.get("sync", {}))
        rollout = state_dict.get("rollout", {})
        self._rollout_epoch, self._steps_started = rollout.get("epoch"), int(rollout.get("steps_started", 0))
        self._drawn_at = None
        rank, ranks, overlapped = self.trainer.global_rank, self.trainer.world_size, bool(self.settings.max_staleness)
        self._saved, redraw_at = saved_for_rank(state_dict.get("pending"), rank, ranks, overlapped)
        if redraw_at is not None:
            self.feed.position = redraw_at
        self._current = self._pending = None

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Count the steps of this rollout that have started (the data module's record for ``state_dict``)."""
        if self.trainer.training:
            self._steps_started += 1
        return batch

    def on_exception(self, exception: BaseException) -> None:
        """Say where a SIGTERM stopped the run and where it resumes from (``amir`` prints it as it exits)."""
        if not isinstance(exception, SIGTERMException):
            return
        trainer = self.trainer
        if trainer.state.fn != "fit":  # amir test, validate: nothing to resume, run it again
            exception.amir_where = f" during amir {trainer.state.fn.value}"  # type: ignore[attr-defined]
            return
        done = trainer.current_epoch  # rollouts whose epoch completed
        total = f" of {trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        last = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
        resume = (
            f"; the last checkpoint is {last}: resume with the same command and --ckpt_path last"
            if last
            else "; no checkpoint was written yet"
        )
        exception.amir_where = f" with {done}{total} rollouts done{resume}"  # type: ignore[attr-defined]

    @override
    def teardown(self, stage: str) -> None:
        for reward in [*self.rewards, self._eval_grader]:
            if reward is not None:
                reward.close()

    # ------------------------------------------------------------------ prompts
    def next_prompts(self) -> list[Prompt]:
        """This process's ``prompts_per_process`` prompts, recorded as the rollout this epoch draws."""
        self._rollout_epoch, self._drawn_at, self._steps_started = self.trainer.current_epoch, self.feed.position, 0
        return self._draw()

    def _draw(self) -> list[Prompt]:
        return self.feed.draw(self.trainer.global_rank, self.trainer.world_size, self.settings.prompts_per_process)

    def tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Chat-templated token ids; a prompt over the limit (``prompt_limit``) is an error naming it."""
        return self.feed.tokenize(self.tokenizer, prompts)

    def screen_evaluation_prompts(self, stage: str) -> None:
        """Render the prompts evaluation will use before the engine starts; one over ``prompt_limit`` is an error.

        The held-out prompts for fit and validate, the benchmarks (else the held-out prompts) for test. The error
        names the prompt; leaving it out would change what the evaluation measures.
        """
        size = self.evaluation.val_size
        sources = [(s, len(s)) for s in self.benchmarks] if stage == "test" and self.benchmarks else []
        if not sources and self.val_prompts is not None and stage in ("fit", "validate", "test"):
            sources = [(self.val_prompts, min(size, len(self.val_prompts)))]
        for source, count in sources:
            prompts = [source[i] for i in range(count)]
            render_prompts(self.tokenizer, prompts, self.chat, self.prompt_limit, source.describe())

    # ------------------------------------------------------------------ the engine
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        purpose: int,
        prompts: list[Prompt] | None = None,
    ) -> list[list[Completion]]:
        """Sample with the seed of (seed, optimisation step, rank, ``purpose``), episodes with ``prompts``."""
        seed = self._seed(purpose)
        return self.sampler.generate(prompt_ids, n, sampling, seed, prompts, self.tokenizer)

    def _seed(self, purpose: int) -> int:
        return generation_seed(self.seed, self.trainer.global_step, self.trainer.global_rank, purpose)

    def sync(self, probe_prompt: list[int], probe_answer: str) -> float:
        """Push the policy into the engine (once per optimisation step) and verify it; returns the probe gap.

        The first sync fixes the probe (this prompt and its answer) for the rest of the run.
        """
        if self._pending is not None:  # a rollout sampling in the background finishes on the weights it started with
            self._pending.wait()
        probe = (probe_prompt, probe_answer)
        report = self.sampler.push(self.policy, self.trainer.global_step, probe, self._max_over_processes)
        if report is None:  # pushed at this step already
            return 0.0
        metrics = {"rollout/sync_logp_diff": report.gap, "rollout/sync_tolerance": report.tolerance}
        log_metrics(self.trainer, metrics | {"rollout/sync_verified_tensors": report.verified})
        return report.gap

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        """This epoch's rollout as the optimisation steps it feeds (``RolloutStep``), in order."""
        done = self._steps_started
        if self._rollout_epoch == self.trainer.current_epoch and done:
            # Resuming from a checkpoint written inside this epoch, after its rollout's steps started (at its end,
            # or after its validation): Lightning reloads only to see that the epoch's batches are done and skips
            # them. A new rollout would be wasted and skip prompts, so it gets placeholders it never reads (a
            # checkpoint taken in the middle of a rollout resumes at the next rollout).
            return DataLoader([None] * done, batch_size=None, collate_fn=_identity)
        rollout = self._rollout_overlapped() if self.settings.max_staleness else self._rollout_in_turn()
        settings = self.settings
        self.reward_guard.check(rollout.metrics)
        self._log(rollout.metrics)
        groups = rollout.trained_groups(settings.drop_zero_std_groups)
        plan = plan_steps(groups, settings.steps_per_rollout, settings.micro_batch_groups, settings.micro_batch_tokens)
        plan = agree_on_plan(plan, settings.steps_per_rollout, self._max_over_processes)
        steps = build_steps(plan, self.policy.pad_token_id, settings.passes, filler=rollout.groups[0], rollout=rollout)
        if len(steps) > 1:  # steps after the first follow an update: their ratios need the sampling policy's logps
            for batch in {id(b): b for step in steps for b in step.micro_batches}.values():
                if batch.old_logps is None:  # a rollout sampled by older weights has them already
                    batch.old_logps = self.policy.logps(batch)  # the trainer's numerics (the engine's differ)
        return DataLoader(steps, batch_size=None, collate_fn=_identity)

    def _rollout_in_turn(self) -> Rollout:
        """Sync, then sample and score this epoch's rollout from the weights it trains (``max_staleness`` 0)."""
        prompts = self.next_prompts()
        prompt_ids = self.tokenize(prompts)
        start = time.perf_counter()
        self.sync(prompt_ids[0], prompts[0].answer)
        sync_s = time.perf_counter() - start

        def generate(ids: list[list[int]], n: int):
            return self.generate(ids, n, self.sampling, purpose=TRAIN, prompts=prompts)

        rollout = collect_rollout(prompts, prompt_ids, generate, self.rewards, self.settings, self._sum_over_processes)
        self.engine.sleep()  # a colocated engine with sleep mode lends its memory to training until the next sync
        rollout.seconds["sync_s"] = sync_s
        rollout.metrics["rollout/sync_s"] = sync_s
        return rollout

    def _rollout_overlapped(self) -> Rollout:
        """This epoch's rollout, sampled while the previous one trained; the next one starts sampling here.

        The run's first rollout (and the first after a resume without a saved one) is sampled now, from the weights
        it trains. Every later one was sampled from the weights its predecessor started with: the trainer scores
        its tokens under those weights (the old log-probs of its ratios) before its first update.
        """
        trainer = self.trainer
        current = self._pending or self._restore_saved()
        self._pending = None
        start = time.perf_counter()
        if current is None:
            prompts = self.next_prompts()
            prompt_ids = self.tokenize(prompts)
            self.sync(prompt_ids[0], prompts[0].answer)
            current = PendingRollout(prompts, prompt_ids, self._drawn_at, trainer.global_step, {})
            n = self.settings.group_size
            current.completions = self.generate(prompt_ids, n, self.sampling, purpose=TRAIN, prompts=prompts)
            current.generate_s = time.perf_counter() - start
        self._rollout_epoch, self._steps_started, self._drawn_at = trainer.current_epoch, 0, None
        self._current = current
        completions = current.wait()
        waited = time.perf_counter() - start
        # Also after the last rollout: the checkpoint then holds the next one, and a run resumed to train longer
        # goes on as if it had never stopped.
        start = time.perf_counter()
        self._pending = self._sample_ahead()
        sync_s = time.perf_counter() - start
        scored = all(c.old_logprobs is not None for group in completions for c in group)  # a checkpoint kept them
        if current.version != trainer.global_step and self.settings.stale_logps == "sampler" and not scored:
            groups = self.settings.micro_batch_groups
            self.policy.score_under(current.weights, current.prompt_ids, completions, groups)

        def sampled(ids: list[list[int]], n: int):
            return completions

        scores = current.score(self.rewards, self.settings.reward_warn_s)  # a checkpoint's rollout kept its own
        rollout = collect_rollout(
            current.prompts, current.prompt_ids, sampled, self.rewards, self.settings, self._sum_over_processes, scores
        )
        tokens = sum(c.policy_tokens for group in completions for c in group)
        rollout.seconds.update(generate_s=current.generate_s, sync_s=sync_s, wait_s=waited)
        rollout.metrics.update(
            {
                "rollout/generate_s": current.generate_s,
                "rollout/tokens_per_s": tokens / max(current.generate_s, 1e-9),
                "rollout/sync_s": sync_s,
                "rollout/wait_s": waited,  # the trainer's wait for this rollout (0 when sampling kept up)
                "rollout/staleness": float(trainer.global_step - current.version),  # updates since its weights
            }
        )
        return rollout

    def _sample_ahead(self) -> PendingRollout:
        """Push the weights this epoch trains from and start sampling the next rollout from them, in the background."""
        drawn_at = self.feed.position
        prompts = self._draw()
        prompt_ids = self.tokenize(prompts)
        self.sync(prompt_ids[0], prompts[0].answer)
        keep = self.settings.stale_logps == "sampler"  # the weights that will score it
        version, weights = self.trainer.global_step, self.policy.trainable_weights() if keep else {}
        pending = PendingRollout(prompts, prompt_ids, drawn_at, version, weights)
        n, seed = self.settings.group_size, self._seed(AHEAD)
        return pending.start(self.sampler.generate_apart(prompts, prompt_ids, n, self.sampling, seed, self.tokenizer))

    def _restore_saved(self) -> PendingRollout | None:
        """The rollout a checkpoint held, its prompts drawn again from where they were drawn."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        self.feed.position = saved.drawn_at
        prompts, rank, ranks = self._draw(), self.trainer.global_rank, self.trainer.world_size
        return restore(saved, prompts, self.tokenize(prompts), rank, ranks, self._max_over_processes)

    @override
    def val_dataloader(self) -> DataLoader | list:
        batches = self.evaluator().validation_batches(self.val_prompts)
        return DataLoader(batches, batch_size=None, collate_fn=_identity) if batches else []

    def test_dataloader(self) -> DataLoader:
        """``amir test``: every benchmark of ``benchmarks`` (else the held-out prompts), one batch each."""
        batches = self.evaluator().test_batches(self.benchmarks, self.val_prompts)
        return DataLoader(batches, batch_size=None, collate_fn=_identity)

    def evaluator(self) -> Evaluator:
        """Evaluation through this module's engine, with its prompt rendering, weight sync and seeding."""
        progress = self.trainer.is_global_zero and self.trainer.progress_bar_callback is not None
        return Evaluator(self.evaluation, self.tokenize, self.sync, self.generate, self.grader(), progress)

    def grader(self) -> MathAnswerReward:
        """The correctness check of evaluation: the first ``MathAnswerReward`` of the rewards, or a default one."""
        found = next((r for r in self.rewards if isinstance(r, MathAnswerReward)), None)
        if found is None:
            if self._eval_grader is None:
                self._eval_grader = MathAnswerReward()
            found = self._eval_grader
        return found

    # ------------------------------------------------------------------ collectives
    def _sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce(values, "sum", self.trainer.strategy.root_device)

    def _max_over_processes(self, values: list[float]) -> list[float]:
        return all_reduce(torch.tensor(values, dtype=torch.float64), "max", self.trainer.strategy.root_device).tolist()

    def _log(self, metrics: dict[str, float]) -> None:
        """Log rollout metrics averaged over processes, and the rollout's line; every process must call it."""
        keys = sorted(metrics)
        values = all_reduce(torch.tensor([float(metrics[k]) for k in keys]), "mean", self.trainer.strategy.root_device)
        reduced = dict(zip(keys, values.tolist()))
        log_metrics(self.trainer, reduced)
        now = time.perf_counter()
        self._rollout_times.append(now)
        if self.trainer.is_global_zero:
            log.info(
                "%s: reward %.3f +- %.3f, %.0f%% of groups with reward variance, %.0f tokens/s, length %.1f "
                "(%.0f%% truncated)%s",
                f"rollout {self.trainer.current_epoch + 1}"
                + (f" of {self.trainer.max_epochs}" if self.trainer.max_epochs and self.trainer.max_epochs > 0 else ""),
                reduced["rollout/reward_mean"],
                reduced["rollout/reward_std"],
                100 * (1 - reduced["rollout/zero_std_frac"]),
                reduced["rollout/tokens_per_s"],
                reduced["length/mean"],
                100 * reduced["length/truncated_frac"],
                time_left(self._rollout_times, self.trainer.current_epoch + 1, self.trainer.max_epochs),
            )
