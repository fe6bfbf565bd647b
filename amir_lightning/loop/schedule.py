"""When a rollout is sampled, and from which weights: in turn (``InTurn``) or while the policy trains (``Ahead``).

A schedule gives the data module the rollout of each epoch (``next_rollout(at)``) and keeps its own record of where
the run is, for checkpoints (``state_dict``, ``load_state_dict``): the epoch of the rollout last drawn, the prompt
stream's position before that draw, how many of its steps have started, and, ahead, the rollouts sampling meanwhile.

- ``InTurn`` (``data.rollout.max_staleness`` 0): push the weights, sample from them, train on what they sampled.
- ``Ahead`` (``max_staleness`` N >= 1): the rollout an epoch trains was sampled while earlier epochs trained, from
  weights at most N epochs older; right after taking it, the schedule pushes this epoch's weights and starts the
  next one. Its rollouts sampling meanwhile sit in a hand-off of N, oldest first; with ``partial_rollouts`` a push
  reaches them in flight and their later tokens are sampled by the newer weights.

Lightning's counters reach a schedule once per epoch, frozen, as ``At``: nothing here reads the trainer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.feed import PromptFeed
from amir_lightning.engines.base import Completion, SamplingConfig
from amir_lightning.helpers.distributed import Collectives
from amir_lightning.loop.collect import RolloutSettings, make_rollout
from amir_lightning.loop.dynamic import Refill, Round, needs_more
from amir_lightning.loop.pending import PendingRollout, SavedRollout
from amir_lightning.loop.rewarding import Scores
from amir_lightning.loop.sampler import AHEAD, TRAIN, Sampler, generation_seed, round_seed
from amir_lightning.loop.saved import gather_saved, restore, saved_for_rank
from amir_lightning.loop.types import Rollout
from amir_lightning.models.policy import Policy
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.inputs import RunState

#: ``PromptFeed.draw`` or ``draw_refill``: ``(rank, ranks, per_rank)`` -> this process's prompts.
Draw = Callable[[int, int, int], list[Prompt]]


@dataclass(frozen=True)
class At:
    """Where the run stands when an epoch asks for its rollout: Lightning's counters, read once.

    Attributes:
        epoch: ``trainer.current_epoch``.
        step: ``trainer.global_step``, the optimisation steps done (the version of the weights).
        rank: Global rank of this process.
        ranks: Processes of the run.
        device: Where the collectives run (CUDA for NCCL).
        max_steps: Optimisation steps the run is set to take (-1: unbounded), for the rewards' ``trainer_state``.
    """

    epoch: int
    step: int
    rank: int = 0
    ranks: int = 1
    device: torch.device | None = None
    max_steps: int = -1

    @property
    def sum_over_processes(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Sums a tensor over processes (``helpers/distributed.py``'s ``Collectives``: every process must call it)."""
        return Collectives(self.device).sum_over_processes

    @property
    def max_over_processes(self) -> Callable[[list[float]], list[float]]:
        """Takes element-wise maxima over processes (``Collectives``: every process must call it)."""
        return Collectives(self.device).max_over_processes


class Schedule(ABC):
    """What both schedules share: the record of the rollout the run is in, the draw and the push.

    Args:
        feed: The prompt stream.
        sampler: The engine, its seeding and the verified push.
        policy: The trained policy (tokenizer, weights, scoring).
        rewards: Summed with their weights (``data.rewards``).
        settings: ``data.rollout``.
        sampling: ``data.sampling``.
        seed: ``data.seed``, of the generation seeds.
    """

    def __init__(
        self,
        feed: PromptFeed,
        sampler: Sampler,
        policy: Policy,
        rewards: list[Reward],
        settings: RolloutSettings,
        sampling: SamplingConfig,
        seed: int,
    ) -> None:
        self.feed, self.sampler, self.policy, self.rewards = feed, sampler, policy, rewards
        self.settings, self.sampling, self.seed = settings, sampling, seed
        self.epoch: int | None = None  # of the rollout last drawn
        self.drawn_at: int | None = None  # the stream's position before that draw, until its steps start
        self.steps_started = 0
        self._saved: list[SavedRollout] | None = None  # the next rollouts to train, as a checkpoint brought them back

    #: Whether it samples ahead: a checkpoint's rollout sampled ahead is resumed, not sampled again.
    overlapped = False

    @abstractmethod
    def next_rollout(self, at: At) -> Rollout:
        """The rollout epoch ``at.epoch`` trains; every process must call it."""

    def step_started(self) -> None:
        """One more step of this rollout has started (its state is then that of a rollout in training)."""
        self.steps_started += 1

    def steps_done(self, epoch: int) -> int:
        """Steps of ``epoch``'s rollout that ran before a checkpoint (0 unless the run resumed inside ``epoch``)."""
        return self.steps_started if self.epoch == epoch else 0

    def finish_sampling(self) -> None:  # noqa: B027 (in turn, nothing samples between rollouts)
        """Wait until the engine samples nothing for this schedule (before a push from elsewhere: evaluation)."""

    def sample_evaluation(
        self, at: At, prompts: list[Prompt], n: int, sampling: SamplingConfig, purpose: int
    ) -> tuple[list[list[int]], list[list[Completion]], dict[str, float]]:
        """Held-out ``prompts`` sampled from this step's weights: their ids, ``n`` completions each, the sync's metrics.

        What samples ahead finishes first, on the weights it started with; the push is once per step, as training's.
        """
        self.finish_sampling()
        prompt_ids = self.feed.tokenize(self.policy.tokenizer, prompts)
        sync = self._verified_push(at, prompts, prompt_ids)  # untimed: rollout/sync_s is a training rollout's
        seed = self._seed(at, purpose)
        completions = self.sampler.generate(prompt_ids, n, sampling, seed, prompts, self.policy.tokenizer)
        return prompt_ids, completions, sync

    def state_dict(self) -> dict:
        """The prompt stream's position and the record of the rollout the run is in.

        A checkpoint written after this rollout's prompts were drawn but before any of its steps started (SLURM's
        requeue checkpoint, saved whenever the signal comes, often mid-generation) holds the position before the
        draw: its resume, which runs the rollout again, draws the same prompts, as an uninterrupted run does.
        """
        drawn_only = self.drawn_at is not None and not self.steps_started
        cursor = self.drawn_at if drawn_only else self.feed.position
        return {"cursor": cursor, "rollout": {"epoch": self.epoch, "steps_started": self.steps_started}}

    def load_state_dict(self, state: dict, at: At) -> None:
        """Go back to where ``state`` (``state_dict``'s) was; ``at`` says which process this is."""
        self.feed.position = int(state["cursor"])
        rollout = state.get("rollout", {})
        self.epoch, self.steps_started = rollout.get("epoch"), int(rollout.get("steps_started", 0))
        self.drawn_at = None
        self._saved, redraw_at = saved_for_rank(state.get("pending"), at.rank, at.ranks, self.overlapped)
        if redraw_at is not None:  # it cannot be resumed here: its prompts are drawn again
            self.feed.position = redraw_at

    def _draw(self, at: At) -> tuple[list[Prompt], list[list[int]]]:
        """This process's next prompts and their token ids (the stream moves on)."""
        prompts = self.feed.draw(at.rank, at.ranks, self.settings.prompts_per_process)
        return prompts, self.feed.tokenize(self.policy.tokenizer, prompts)

    def _draw_for(self, at: At) -> tuple[list[Prompt], list[list[int]]]:
        """``_draw``, recorded as the rollout of epoch ``at.epoch``, none of whose steps has started."""
        self.epoch, self.drawn_at, self.steps_started = at.epoch, self.feed.position, 0
        return self._draw(at)

    def _push(self, at: At, prompts: list[Prompt], prompt_ids: list[list[int]]) -> dict[str, float]:
        """Push the policy into the engine (once per optimisation step) and verify it; the sync's metrics.

        The run's first push fixes the probe (this rollout's first prompt and its answer) for the rest of the run.
        """
        start = time.perf_counter()
        metrics = self._verified_push(at, prompts, prompt_ids)
        return metrics | {"rollout/sync_s": time.perf_counter() - start}

    def _verified_push(self, at: At, prompts: list[Prompt], prompt_ids: list[list[int]]) -> dict[str, float]:
        """``_push`` without its time: the sync report's metrics (none when this step's weights are in already)."""
        report = self.sampler.push(self.policy, at.step, (prompt_ids[0], prompts[0].answer), at.max_over_processes)
        return report.metrics() if report is not None else {}

    def _run_state(self, at: At, drawn_at: int) -> RunState:
        """The rewards' ``trainer_state`` of a rollout drawn at stream position ``drawn_at`` by epoch ``at``."""
        return RunState(at.step, self.feed.passes(drawn_at), at.epoch, at.max_steps)

    def _seed(self, at: At, purpose: int) -> int:
        return generation_seed(self.seed, at.step, at.rank, purpose)

    def _sample(self, at: At, prompts: list[Prompt], prompt_ids: list[list[int]], index: int, state: RunState) -> Round:
        """Round ``index`` of this rollout's sampling (its own seed; the first round's is the rollout's), scored."""
        start, n, tokenizer = time.perf_counter(), self.settings.group_size, self.policy.tokenizer
        seed = round_seed(self._seed(at, TRAIN), index)
        completions = self.sampler.generate(prompt_ids, n, self.sampling, seed, prompts, tokenizer)
        generate_s = time.perf_counter() - start
        scores = Scores.of(self.rewards, prompts, completions, self.settings.reward_warn_s, state)
        return Round(prompts, prompt_ids, completions, scores, generate_s)

    def _rollout(
        self,
        at: At,
        kept: Round,
        seconds: dict[str, float],
        metrics: dict[str, float],
        old_weights: dict[str, torch.Tensor] | None = None,
    ) -> Rollout:
        """The rollout of the round ``kept`` (scored): its groups and advantages, the loop's seconds and metrics."""
        return make_rollout(
            kept.prompts,
            kept.prompt_ids,
            kept.completions,
            kept.generate_s,
            self.rewards,
            self.settings,
            at.sum_over_processes,
            kept.scores,
            more_seconds=seconds,
            more_metrics=metrics,
            old_weights=old_weights,
        )

    def _refill(self, at: At, first: Round, draw: Draw, state: RunState) -> tuple[Round, dict[str, float]]:
        """Dynamic sampling (``loop/dynamic.py``): ``first``, scored, and more rounds until the groups vary.

        The further rounds draw their prompts from ``draw``, sample them from the weights in the engine and score
        them with the rollout's ``state``. A process whose groups are full draws its share of the stream and skips
        it, as every process draws alike.
        """
        settings = self.settings
        wanted, size, most = settings.prompts_per_process, settings.group_size, settings.max_sampling_rounds
        refilling = Refill(first, wanted, size, most, at.max_over_processes)
        while count := refilling.next_draw():
            prompts = draw(at.rank, at.ranks, count)
            extra = None
            if refilling.missing:
                ids = self.feed.tokenize(self.policy.tokenizer, prompts)
                extra = self._sample(at, prompts, ids, refilling.index, state)
            refilling.add(extra)
        return refilling.result()

    def _needs_more(self, at: At, first: Round) -> bool:
        settings = self.settings
        wanted, size, rounds = settings.prompts_per_process, settings.group_size, settings.max_sampling_rounds
        return needs_more(first, wanted, size, rounds, at.max_over_processes)


class InTurn(Schedule):
    """Sample each rollout from the weights it trains, then train (``max_staleness`` 0)."""

    @override
    def next_rollout(self, at: At) -> Rollout:
        prompts, prompt_ids = self._draw_for(at)
        state = self._run_state(at, self.drawn_at)
        sync = self._push(at, prompts, prompt_ids)
        first = self._sample(at, prompts, prompt_ids, 0, state)
        settings, dynamic = self.settings, {}
        if settings.dynamic_sampling:  # more rounds, from these weights, until the groups have reward variance
            first, dynamic = self._refill(at, first, self.feed.draw, state)
        self.sampler.sleep()  # a colocated engine with sleep mode lends its memory to training until the push
        return self._rollout(at, first, {"sync_s": sync["rollout/sync_s"]}, sync | dynamic)


class Ahead(Schedule):
    """Sample the next rollouts while the policy trains on this one (``max_staleness`` N >= 1, an engine apart).

    The run's first rollout (and the first after a resume without a saved one) is sampled in turn, from the weights
    it trains; right after it, N rollouts start sampling from those weights. Each later epoch takes the oldest,
    pushes its own weights and starts one more, so N are always sampling: each rollout was sampled by weights N
    epochs older than those it trains, at most (with ``partial_rollouts`` a push reaches the rollouts in flight,
    whose later tokens are sampled by newer weights). The trainer's log-probs of its tokens under the weights that
    sampled it (``stale_logps: sampler``, N = 1) or under the current ones weigh its staleness.
    """

    overlapped = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.current: PendingRollout | None = None  # the rollout this epoch trains
        self.refill_from: int | None = None  # the refill stream's position before this epoch's further rounds
        self.ahead: deque[PendingRollout] = deque()  # sampling now, oldest first: at most max_staleness of them
        self.started_now = 0  # how many of ``ahead`` (the newest) this epoch started, from its own weights

    @override
    def next_rollout(self, at: At) -> Rollout:
        start = time.perf_counter()
        current = self.ahead.popleft() if self.ahead else self._restore_saved(at)
        sync: dict[str, float] = {}
        if current is None:  # nothing sampled ahead: sample it now, from the weights it trains
            prompts, prompt_ids = self._draw_for(at)
            sync = self._push(at, prompts, prompt_ids)
            state = self._run_state(at, self.drawn_at)
            tokenizer, seed = self.policy.tokenizer, self._seed(at, TRAIN)
            n, generated = self.settings.group_size, time.perf_counter()
            completions = self.sampler.generate(prompt_ids, n, self.sampling, seed, prompts, tokenizer)
            current = PendingRollout(prompts, prompt_ids, self.drawn_at, at.step, {}, state, generated)
            current = current.sampled(completions, time.perf_counter() - generated)
        self.epoch, self.steps_started, self.drawn_at, self.current = at.epoch, 0, None, current
        self.refill_from = self.feed.refill_position  # a checkpoint from here on runs this rollout again
        completions = tagged(current.wait(), current.version)
        waited = time.perf_counter() - start
        scores = current.score(self.rewards, self.settings.reward_warn_s)  # a checkpoint's rollout kept its own
        first, dynamic = Round(current.prompts, current.prompt_ids, completions, scores, current.generate_s), {}
        if self.settings.dynamic_sampling:
            # The further rounds sample from the weights this epoch trains, pushed first (only when a round will
            # sample: a push waits for the rollouts in flight), and alone on the engine with max_staleness 1 (a resumed
            # run samples them again alike); their prompts come from the refill stream (``data/feed.py``).
            if self._needs_more(at, first):
                sync = joined(sync, self._push(at, current.prompts, current.prompt_ids))
            first, dynamic = self._refill(at, first, self.feed.draw_refill, current.run_state)
            first = replace(first, completions=tagged(first.completions, at.step))  # the further rounds' tokens
        # Also after the last rollout: the checkpoint then holds the next ones, and a run resumed to train longer
        # goes on as if it had never stopped.
        sync = joined(sync, self._sample_ahead(at))
        # rollout/wait_s: the trainer's wait for this rollout (0 when sampling kept up)
        per_rollout = self.settings.steps_per_rollout * self.settings.passes
        age = staleness(first.completions, current.version, at.step, per_rollout)
        more = sync | dynamic | {"rollout/wait_s": waited} | age
        old_weights = None
        if current.version != at.step and self.settings.stale_logps == "sampler":  # exact PPO ratios
            old_weights = current.weights  # the ratios' old log-probs are the trainer's under these
        return self._rollout(at, first, {"sync_s": sync["rollout/sync_s"], "wait_s": waited}, more, old_weights)

    def _sample_ahead(self, at: At) -> dict[str, float]:
        """Push the weights this epoch trains from and start sampling from them; the sync's metrics.

        As many rollouts start as ``max_staleness`` lacks ahead: one each epoch, but for the run's first.
        """
        sync: dict[str, float] = {}
        keep = self.settings.stale_logps == "sampler"  # the weights that will score them
        self.started_now = self.settings.max_staleness - len(self.ahead)
        for index in range(self.started_now):
            drawn_at = self.feed.position
            prompts, prompt_ids = self._draw(at)
            sync = sync or self._push(at, prompts, prompt_ids)  # once per epoch
            weights = self.policy.trainable_weights() if keep else {}
            pending = PendingRollout(prompts, prompt_ids, drawn_at, at.step, weights, self._run_state(at, drawn_at))
            n, seed, tokenizer = (
                self.settings.group_size,
                round_seed(self._seed(at, AHEAD), index),
                self.policy.tokenizer,
            )
            self.ahead.append(self.sampler.start_apart(pending, n, self.sampling, seed, tokenizer))
        return sync

    @override
    def finish_sampling(self) -> None:
        for pending in self.ahead:  # a rollout sampling in the background finishes on the weights it started with
            pending.wait()

    def _next_to_train(self) -> tuple[list[PendingRollout | SavedRollout], int | None]:
        """The rollouts a resumed run trains next, oldest first, and the stream position it resumes at.

        After this rollout's steps started, those are the ones sampling meanwhile. Before, this one, which then runs
        again, and those that earlier epochs started (from older weights, which the resumed run no longer has); the
        ones this epoch started are started again, from these same weights, drawing their prompts again from where
        they were drawn.
        """
        if self.current is not None and not self.steps_started:
            older = list(self.ahead)[: len(self.ahead) - self.started_now]
            cursor = self.ahead[len(older)].drawn_at if self.started_now else self.feed.position
            return [self.current, *older], cursor
        return (list(self.ahead) if self.ahead else list(self._saved or [])), None

    @override
    def state_dict(self) -> dict:
        """Also every process's rollouts a resumed run trains next, scored (``loop/saved.py``).

        Every process must call it: it waits for their sampling to finish, and rank 0 writes them all.
        """
        state = super().state_dict()
        rollouts, cursor = self._next_to_train()
        for rollout in rollouts:
            if any(rollout is other for other in self.ahead):
                rollout.score(self.rewards, self.settings.reward_warn_s)  # this run and a resumed one train these
        states = [rollout.state() for rollout in rollouts]
        state["pending"] = gather_saved(states or None, not self.policy.sharded)
        if cursor is not None:
            state["cursor"] = cursor
        again = cursor is not None and self.refill_from is not None  # this rollout runs again, its rounds with it
        state["refill_cursor"] = self.refill_from if again else self.feed.refill_position
        return state

    @override
    def load_state_dict(self, state: dict, at: At) -> None:
        super().load_state_dict(state, at)
        self.feed.refill_position = int(state.get("refill_cursor", 0))
        self.current, self.refill_from, self.started_now = None, None, 0
        self.ahead.clear()

    def _restore_saved(self, at: At) -> PendingRollout | None:
        """The oldest of the rollouts a checkpoint held; the others sample ahead again (sampled already).

        Their prompts are drawn again from where they were drawn.
        """
        saved, self._saved = self._saved, None
        if not saved:
            return None
        saved = saved[: self.settings.max_staleness]  # resumed with fewer ahead: the later ones' prompts sample again
        restored = []
        for one in saved:
            self.feed.position = one.drawn_at
            prompts, prompt_ids = self._draw(at)
            restored.append(restore(one, prompts, prompt_ids, at.rank, at.ranks, at.max_over_processes))
        self.ahead.extend(restored[1:])
        return restored[0]


def tagged(completions: list[list[Completion]], version: int) -> list[list[Completion]]:
    """The completions, each token without a weight version tagged with ``version`` (the one that sampled it)."""
    return [
        [c if c.versions is not None else replace(c, versions=[version] * len(c.token_ids)) for c in group]
        for group in completions
    ]


def joined(first: dict[str, float], then: dict[str, float]) -> dict[str, float]:
    """The sync metrics of two pushes in one epoch: both reports (the later's where both have one), seconds summed."""
    if not first or not then:
        return first or then
    return first | then | {"rollout/sync_s": first["rollout/sync_s"] + then["rollout/sync_s"]}


def staleness(completions: list[list[Completion]], version: int, step: int, steps_per_rollout: int) -> dict[str, float]:
    """How stale a rollout sampled from weight ``version`` is when trained at optimisation ``step``.

    In the unit ``data.rollout.max_staleness`` bounds, rollouts: how many rollouts ago the weights that started
    sampling it were pushed (``rollout/staleness_rollouts``, at most ``max_staleness``). In optimiser steps, what the
    importance weights see: the updates between the weights that sampled each token (``Completion.versions``) and
    those it trains, mean and max over tokens (``rollout/staleness_steps``, ``rollout/staleness_steps_max``); and
    the share of its completions sampled across a push.
    """
    ages, spanning, count = [], 0, 0
    for completion in (c for group in completions for c in group):
        versions = completion.versions or [version] * len(completion.token_ids)
        ages += [step - v for v in versions]
        spanning += len(set(versions)) > 1
        count += 1
    return {
        "rollout/staleness_rollouts": (step - version) / steps_per_rollout,
        "rollout/staleness_steps": sum(ages) / len(ages) if ages else float(step - version),
        "rollout/staleness_steps_max": float(max(ages)) if ages else float(step - version),
        "rollout/spanning_frac": spanning / max(count, 1),
    }
