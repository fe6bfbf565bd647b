"""RolloutDataModule: one epoch is one rollout, from weight sync to micro-batches of whole groups.

Each epoch syncs the policy into the engine, samples G completions for the next B prompts, scores them, and
yields micro-batches of whole groups.

The weight sync sits at the top of ``train_dataloader()``: Lightning reloads the dataloader *before*
``on_train_epoch_start``, so a callback there would generate with stale weights.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.data.stream import PromptStream
from amir_lightning.data.templates import render_prompts
from amir_lightning.distributed import all_reduce
from amir_lightning.evaluation.evaluator import Evaluator
from amir_lightning.objectives.advantages import batch_std, group_advantages
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rollout.arguments import check_arguments
from amir_lightning.rollout.batch import Group, build_steps, make_groups, repeat_passes
from amir_lightning.rollout.engine import RolloutEngine, SamplingConfig
from amir_lightning.rollout.scoring import RewardGuard, score_completions
from amir_lightning.rollout.sync import SyncCheck
from amir_lightning.tracking import log_metrics

log = logging.getLogger(__name__)


def _identity(batch):
    return batch


class RolloutDataModule(LightningDataModule):
    """On-policy rollouts from a prompt source through a rollout engine, scored by rewards.

    Args:
        prompts: Training prompt source.
        engine: Rollout engine (``VLLMEngine`` or ``HFEngine``).
        rewards: Rewards summed with their weights; default a ``MathAnswerReward``.
        group_size: ``G``, completions per prompt (>= 2).
        prompts_per_epoch: ``B``, prompts per rollout (one epoch) and process; the global batch is B x processes.
        micro_batch_groups: Groups per micro-batch (gradient accumulation splits a step into micro-batches).
        steps_per_rollout: Optimisation steps per rollout, each on its share of the groups.
        mu: Passes over the rollout (PPO-style); > 1 makes later steps off-policy (ratios and clipping act).
        sampling: Sampling settings for training rollouts.
        system_prompt: System message prepended to every prompt (e.g. ``THINK_ANSWER_SYSTEM_PROMPT``).
        advantage_scale: ``group``, ``batch`` or ``none`` (see ``group_advantages``).
        drop_zero_std_groups: Skip groups whose rewards are all equal (they carry no policy gradient).
        shuffle: Shuffle a finite prompt source once per pass over it.
        max_prompt_tokens: Longest allowed prompt after the chat template.
        sync_tolerance: Largest allowed |engine - trainer| log-prob on the sync probe before stopping; ``None``
            measures it from the noise at the first sync and the policy's drift since (``rollout/sync.py``),
            which is what bf16 engines need.
        val_prompts: Held-out prompts for ``validate`` and validation during ``fit``.
        val_size: Held-out prompts evaluated (the first ``val_size`` of ``val_prompts``).
        val_samples: Samples per held-out prompt.
        val_sampling: Sampling for evaluation (default: the paper's temperature 0.6, same length limit).
        benchmarks: Benchmarks for ``amir test`` (``BenchmarkPrompts``); default: the held-out prompts.
        eval_samples: Samples per problem in ``amir test`` (the paper: 8).
        eval_sampling: Sampling in ``amir test`` (default: the paper's temperature 0.6, top_p 1.0).
        eval_ks: The k of ``eval/<benchmark>/pass@k`` (the paper: 1, 2, 4); each must be <= ``eval_samples``.
        eval_logps: Per-sample mean log-probs in the reports (for ``amir compare`` margins): ``engine`` (free, at
            the evaluation temperature) or ``policy`` (a forward over every sample, temperature 1).
        max_bad_rollouts: Stop after this many rollouts in a row with NaN or inf rewards.
        seed: Seed of prompt shuffling and the engine.
    """

    def __init__(
        self,
        prompts: PromptSource,
        engine: RolloutEngine,
        rewards: list[Reward] | None = None,
        group_size: int = 8,
        prompts_per_epoch: int = 16,
        micro_batch_groups: int = 2,
        steps_per_rollout: int = 1,
        mu: int = 1,
        sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (a frozen-by-convention config, never mutated)
        system_prompt: str | None = None,
        advantage_scale: Literal["group", "batch", "none"] = "group",
        drop_zero_std_groups: bool = False,
        shuffle: bool = True,
        max_prompt_tokens: int = 512,
        sync_tolerance: float | None = None,
        val_prompts: PromptSource | None = None,
        val_size: int = 64,
        val_samples: int = 4,
        val_sampling: SamplingConfig | None = None,
        benchmarks: list[PromptSource] | None = None,
        eval_samples: int = 8,
        eval_sampling: SamplingConfig | None = None,
        eval_ks: list[int] | None = None,
        eval_logps: Literal["engine", "policy"] = "engine",
        max_bad_rollouts: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        eval_ks = list(eval_ks or [1, 2, 4])
        check_arguments(
            group_size,
            prompts_per_epoch,
            micro_batch_groups,
            steps_per_rollout,
            mu,
            val_size,
            val_samples,
            eval_samples,
            eval_ks,
            max_prompt_tokens,
            sync_tolerance,
        )
        self.prompts, self.engine = prompts, engine
        self.rewards = list(rewards) if rewards else [MathAnswerReward()]
        self.group_size, self.prompts_per_epoch = group_size, prompts_per_epoch
        self.micro_batch_groups, self.steps_per_rollout, self.mu = micro_batch_groups, steps_per_rollout, mu
        self.sampling = sampling
        self.system_prompt, self.advantage_scale = system_prompt, advantage_scale
        self.drop_zero_std_groups, self.shuffle = drop_zero_std_groups, shuffle
        self.max_prompt_tokens, self.sync_check = max_prompt_tokens, SyncCheck(sync_tolerance)
        self.val_prompts, self.val_size, self.val_samples = val_prompts, val_size, val_samples
        paper_eval = SamplingConfig(temperature=0.6, top_p=1.0, max_new_tokens=self.sampling.max_new_tokens)
        self.val_sampling = val_sampling or paper_eval
        self.benchmarks, self.eval_samples, self.eval_ks = list(benchmarks or []), eval_samples, eval_ks
        self.eval_sampling, self.eval_logps = eval_sampling or paper_eval, eval_logps
        self.seed, self.reward_guard, self.stream = (
            seed,
            RewardGuard(max_bad_rollouts),
            PromptStream(prompts, shuffle, seed),
        )
        self.last_rollout: list[Group] = []  # read by the monitors (callbacks)
        self.last_timing: dict[str, float] = {}
        self.synced_at_step: int | None = None
        self._eval_grader: MathAnswerReward | None = None

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str) -> None:  # noqa: D102
        if stage == "fit" and self.trainer.reload_dataloaders_every_n_epochs != 1:
            raise ValueError(
                "trainer.reload_dataloaders_every_n_epochs must be 1: every epoch is a fresh rollout "
                f"(got {self.trainer.reload_dataloaders_every_n_epochs})"
            )
        if self.drop_zero_std_groups and self.trainer.world_size > 1:
            raise ValueError(
                "data.drop_zero_std_groups needs a single process: processes would run different numbers of "
                "micro-batches and data-parallel backward passes would wait on each other"
            )
        module = self.trainer.lightning_module
        if not self.engine.started:
            self.engine.start(module.model_dir, seed=self.seed + self.trainer.global_rank)

    def state_dict(self) -> dict:  # noqa: D102
        return {"cursor": self.stream.position, "sync": self.sync_check.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        self.stream.position = int(state_dict["cursor"])
        self.sync_check.load_state_dict(state_dict.get("sync", {}))

    def teardown(self, stage: str) -> None:  # noqa: D102
        for reward in [*self.rewards, self._eval_grader]:
            if reward is not None:
                reward.close()

    # ------------------------------------------------------------------ prompts
    def next_prompts(self) -> list[Prompt]:
        """This process's ``prompts_per_epoch`` prompts.

        Every process takes the same slice of the stream and keeps its own share, so groups never span processes
        and the stream position stays in step everywhere.
        """
        ranks, rank = self.trainer.world_size, self.trainer.global_rank
        batch = self.stream.take(self.prompts_per_epoch * ranks)
        return batch[rank * self.prompts_per_epoch : (rank + 1) * self.prompts_per_epoch]

    def tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Chat-templated token ids; a prompt over ``max_prompt_tokens`` is an error naming it."""
        tokenizer = self.trainer.lightning_module.tokenizer
        return render_prompts(tokenizer, prompts, self.system_prompt, self.max_prompt_tokens, self.prompts.describe())

    # ------------------------------------------------------------------ loaders
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig, purpose: int):
        """Sample with a seed fixed by (seed, optimisation step, rank, purpose), in a forked RNG.

        A rollout is then a function of the weights and its place in the run, not of hidden engine state: a resumed
        run draws the same rollouts as an uninterrupted one, and the trainer's random stream is untouched.
        """
        rank = self.trainer.global_rank
        seed = ((self.seed * 1_000_003 + self.trainer.global_step) * 65_537 + rank) * 8 + purpose
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed % 2**63)
            return self.engine.generate(prompt_ids, n, sampling)

    def sync(self, probe_prompt: list[int], probe_answer: str) -> float:
        """Push the policy into the engine (once per optimisation step) and verify it; returns the probe gap.

        The first sync fixes the probe (this prompt and its answer) for the rest of the run.
        """
        step = self.trainer.global_step
        if self.synced_at_step == step:
            return 0.0
        module = self.trainer.lightning_module
        self.sync_check.set_probe(module.tokenizer, probe_prompt, probe_answer)

        def reduce_max(values: list[float]) -> list[float]:
            return all_reduce(torch.tensor(values, dtype=torch.float64), "max", module.device).tolist()

        gap, tolerance = self.sync_check.push_and_verify(module, self.engine, reduce_max)
        self.synced_at_step = step
        log_metrics(self.trainer, {"rollout/sync_logp_diff": gap, "rollout/sync_tolerance": tolerance})
        return gap

    def train_dataloader(self) -> DataLoader:  # noqa: D102
        loop = self.trainer.fit_loop
        done = loop.epoch_loop.batch_progress.current.ready
        if loop.epoch_progress.current.started > loop.epoch_progress.current.completed and done:
            # Resuming from a checkpoint written inside this epoch (at its end, or after its validation): Lightning
            # reloads only to see that the epoch's batches are done and skips them. A new rollout would be wasted
            # and skip prompts, so it gets placeholders it never reads (a checkpoint taken in the middle of a
            # rollout resumes at the next rollout).
            return DataLoader([None] * done, batch_size=None, collate_fn=_identity)
        prompts = self.next_prompts()
        prompt_ids = self.tokenize(prompts)
        start = time.perf_counter()
        self.sync(prompt_ids[0], prompts[0].answer)
        sync_s = time.perf_counter() - start
        start = time.perf_counter()
        completions = self.generate(prompt_ids, self.group_size, self.sampling, purpose=0)
        gen_s = time.perf_counter() - start
        start = time.perf_counter()
        rewards, metrics, correct = score_completions(self.rewards, prompts, completions)
        score_s = time.perf_counter() - start
        # A group with a non-finite reward carries no signal (zero advantage, no pairs): see score_completions.
        advantages = self._advantages(rewards)
        self.reward_guard.check(metrics)
        groups = make_groups(prompts, prompt_ids, completions, rewards, advantages, correct)
        zero_std = [bool((g.rewards == g.rewards[0]).all()) for g in groups]
        self.last_rollout = groups
        tokens = sum(len(c.token_ids) for group in completions for c in group)
        self.last_timing = {"sync_s": sync_s, "generate_s": gen_s, "score_s": score_s, "tokens": float(tokens)}
        kept = [g for g, z in zip(groups, zero_std) if not (self.drop_zero_std_groups and z)]
        metrics.update(
            {
                "rollout/zero_std_frac": sum(zero_std) / len(groups),
                "rollout/tokens_per_s": tokens / max(gen_s, 1e-9),
                "rollout/generate_s": gen_s,
                "rollout/sync_s": sync_s,
                "rollout/score_s": score_s,
                "rollout/groups_kept": float(len(kept)),
            }
        )
        reduced = self._log(metrics)
        if self.trainer.is_global_zero:
            log.info(
                "epoch %d: reward %.3f +- %.3f, %.0f%% of groups with reward variance, %.0f tokens/s, length %.1f "
                "(%.0f%% truncated)",
                self.trainer.current_epoch,
                reduced["rollout/reward_mean"],
                reduced["rollout/reward_std"],
                100 * (1 - reduced["rollout/zero_std_frac"]),
                reduced["rollout/tokens_per_s"],
                reduced["length/mean"],
                100 * reduced["length/truncated_frac"],
            )
        pad = self.trainer.lightning_module.pad_token_id
        steps = build_steps(kept, self.micro_batch_groups, self.steps_per_rollout, pad)
        if self.mu > 1 or self.steps_per_rollout > 1:
            # Later steps see an updated policy: their ratios need the sampling policy's log-probs, from the
            # trainer (the engine's differ in the last bits), taken before any update.
            for batch in (batch for step in steps for batch in step.micro_batches):
                batch.old_logps = self.trainer.lightning_module.policy_logps(batch)
        return DataLoader(repeat_passes(steps, self.mu), batch_size=None, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader | list:  # noqa: D102
        batches = self.evaluator().validation_batches(
            self.val_prompts, self.val_size, self.val_samples, self.val_sampling
        )
        return DataLoader(batches, batch_size=None, collate_fn=_identity) if batches else []

    def test_dataloader(self) -> DataLoader:
        """``amir test``: every benchmark of ``benchmarks`` (else the held-out prompts), one batch each."""
        batches = self.evaluator().test_batches(
            self.benchmarks,
            self.val_prompts,
            self.val_size,
            self.eval_samples,
            self.eval_sampling,
            self.eval_ks,
            self.eval_logps,
        )
        return DataLoader(batches, batch_size=None, collate_fn=_identity)

    def evaluator(self) -> Evaluator:
        """Evaluation through this module's engine, with its prompt rendering, weight sync and seeding."""
        return Evaluator(self.tokenize, self.sync, self.generate, self.grader())

    def grader(self) -> MathAnswerReward:
        """The correctness check of evaluation: the first ``MathAnswerReward`` of the rewards, or a default one."""
        found = next((r for r in self.rewards if isinstance(r, MathAnswerReward)), None)
        if found is None:
            if self._eval_grader is None:
                self._eval_grader = MathAnswerReward()
            found = self._eval_grader
        return found

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group advantages; ``batch`` scaling divides by the std of the global batch, over every process."""
        std = None
        if self.advantage_scale == "batch":
            device = self.trainer.lightning_module.device
            std = batch_std(rewards, lambda stats: all_reduce(stats, "sum", device))
        return group_advantages(rewards, self.group_size, self.advantage_scale, std=std).nan_to_num(nan=0.0)

    def _log(self, metrics: dict[str, float]) -> dict[str, float]:
        """Log rollout metrics averaged over processes; every process must call it."""
        keys = sorted(metrics)
        values = all_reduce(
            torch.tensor([float(metrics[k]) for k in keys]), "mean", self.trainer.lightning_module.device
        )
        reduced = dict(zip(keys, values.tolist()))
        log_metrics(self.trainer, reduced)
        return reduced
