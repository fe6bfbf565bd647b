"""When a rollout is sampled, and from which weights: in turn (``InTurn``) or while the policy trains (``Ahead``).

A schedule gives the data module the rollout of each epoch (``next_rollout(at)``) and keeps its own record of where
the run is, for checkpoints (``state_dict``, ``load_state_dict``): the epoch of the rollout last drawn, the prompt
stream's position before that draw, how many of its steps have started, and, ahead, the rollouts sampling meanwhile.

- ``InTurn`` (``data.rollout.max_staleness`` 0): push the weights, sample from them, train on what they sampled.
- ``Ahead`` (``max_staleness`` 1): the rollout an epoch trains was sampled while the epoch before trained, from the
  weights that epoch started with; right after taking it, the schedule pushes this epoch's weights and starts the
  next one. Its rollouts sampling meanwhile sit in a hand-off bounded by ``max_staleness``.

Lightning's counters reach a schedule once per epoch, frozen, as ``At``: nothing here reads the trainer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch
from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.feed import PromptFeed
from amir_lightning.helpers.distributed import all_reduce
from amir_lightning.rewards.base import Reward
from amir_lightning.rollout.collect import RolloutSettings, make_rollout
from amir_lightning.rollout.dynamic import Round, refill
from amir_lightning.rollout.engine import SamplingConfig
from amir_lightning.rollout.pending import PendingRollout, SavedRollout
from amir_lightning.rollout.policy import Policy
from amir_lightning.rollout.rewarding import Scores
from amir_lightning.rollout.sampler import AHEAD, TRAIN, Sampler, generation_seed, round_seed
from amir_lightning.rollout.saved import gather_saved, restore, saved_for_rank
from amir_lightning.rollout.types import Rollout


@dataclass(frozen=True)
class At:
    """Where the run stands when an epoch asks for its rollout: Lightning's counters, read once.

    Attributes:
        epoch: ``trainer.current_epoch``.
        step: ``trainer.global_step``, the optimisation steps done (the version of the weights).
        rank: Global rank of this process.
        ranks: Processes of the run.
        device: Where the collectives run (CUDA for NCCL).
    """

    epoch: int
    step: int
    rank: int = 0
    ranks: int = 1
    device: torch.device | None = None

    def sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over processes (every process must call it)."""
        return all_reduce(values, "sum", self.device)

    def max_over_processes(self, values: list[float]) -> list[float]:
        """``values``, each the largest over processes (every process must call it)."""
        return all_reduce(torch.tensor(values, dtype=torch.float64), "max", self.device).tolist()


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
        self._saved: SavedRollout | None = None  # the next rollout to train, as a checkpoint brought it back

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
        report = self.sampler.push(self.policy, at.step, (prompt_ids[0], prompts[0].answer), at.max_over_processes)
        metrics = report.metrics() if report is not None else {}  # None: pushed at this step already
        return metrics | {"rollout/sync_s": time.perf_counter() - start}

    def _seed(self, at: At, purpose: int) -> int:
        return generation_seed(self.seed, at.step, at.rank, purpose)


class InTurn(Schedule):
    """Sample each rollout from the weights it trains, then train (``max_staleness`` 0)."""

    @override
    def next_rollout(self, at: At) -> Rollout:
        prompts, prompt_ids = self._draw_for(at)
        sync = self._push(at, prompts, prompt_ids)
        first = self._sample(at, prompts, prompt_ids, 0)
        settings, scores, dynamic = self.settings, None, {}
        if settings.dynamic_sampling:  # more rounds, from these weights, until the groups have reward variance
            first.scores = Scores.of(self.rewards, prompts, first.completions, settings.reward_warn_s)
            more = lambda count, index, sample: self._more(at, count, index, sample)  # noqa: E731
            wanted, size, rounds = settings.prompts_per_process, settings.group_size, settings.max_sampling_rounds
            first, dynamic = refill(first, more, wanted, size, rounds, at.max_over_processes)
            scores = first.scores
        self.sampler.sleep()  # a colocated engine with sleep mode lends its memory to training until the push
        rollout = make_rollout(
            first.prompts,
            first.prompt_ids,
            first.completions,
            first.generate_s,
            self.rewards,
            settings,
            at.sum_over_processes,
            scores,
        )
        rollout.seconds["sync_s"] = sync["rollout/sync_s"]
        rollout.metrics |= sync | dynamic
        return rollout

    def _sample(self, at: At, prompts: list[Prompt], prompt_ids: list[list[int]], index: int) -> Round:
        """Round ``index`` of this rollout's sampling (its own seed; the first round's is the rollout's), unscored."""
        start, n, tokenizer = time.perf_counter(), self.settings.group_size, self.policy.tokenizer
        seed = round_seed(self._seed(at, TRAIN), index)
        completions = self.sampler.generate(prompt_ids, n, self.sampling, seed, prompts, tokenizer)
        return Round(prompts, prompt_ids, completions, None, time.perf_counter() - start)

    def _more(self, at: At, count: int, index: int, sample: bool) -> Round | None:
        """Dynamic sampling's round ``index``: ``count`` more prompts drawn, sampled and scored when ``sample``."""
        prompts = self.feed.draw(at.rank, at.ranks, count)
        if not sample:  # this process is full; its share of the stream is skipped, as every process draws alike
            return None
        extra = self._sample(at, prompts, self.feed.tokenize(self.policy.tokenizer, prompts), index)
        extra.scores = Scores.of(self.rewards, prompts, extra.completions, self.settings.reward_warn_s)
        return extra


class Ahead(Schedule):
    """Sample the next rollout while the policy trains on this one (``max_staleness`` 1; the engine in its own process).

    The run's first rollout (and the first after a resume without a saved one) is sampled in turn, from the weights
    it trains. Every later one was sampled from the weights its predecessor started with: the trainer's log-probs
    of its tokens under those weights (``stale_logps: sampler``) or under the current ones weigh its staleness.
    """

    overlapped = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.current: PendingRollout | None = None  # the rollout this epoch trains
        self.ahead: deque[PendingRollout] = deque(maxlen=self.settings.max_staleness)  # sampling now, oldest first

    @override
    def next_rollout(self, at: At) -> Rollout:
        start = time.perf_counter()
        current = self.ahead.popleft() if self.ahead else self._restore_saved(at)
        sync: dict[str, float] = {}
        if current is None:  # nothing sampled ahead: sample it now, from the weights it trains
            prompts, prompt_ids = self._draw_for(at)
            sync = self._push(at, prompts, prompt_ids)
            current = PendingRollout(prompts, prompt_ids, self.drawn_at, at.step, {})
            tokenizer, seed = self.policy.tokenizer, self._seed(at, TRAIN)
            n, generated = self.settings.group_size, time.perf_counter()
            current.completions = self.sampler.generate(prompt_ids, n, self.sampling, seed, prompts, tokenizer)
            current.generate_s = time.perf_counter() - generated
        self.epoch, self.steps_started, self.drawn_at, self.current = at.epoch, 0, None, current
        completions = current.wait()
        waited = time.perf_counter() - start
        # Also after the last rollout: the checkpoint then holds the next one, and a run resumed to train longer
        # goes on as if it had never stopped.
        sync |= self._sample_ahead(at)
        scores = current.score(self.rewards, self.settings.reward_warn_s)  # a checkpoint's rollout kept its own
        rollout = make_rollout(
            current.prompts,
            current.prompt_ids,
            completions,
            current.generate_s,
            self.rewards,
            self.settings,
            at.sum_over_processes,
            scores,
        )
        if current.version != at.step and self.settings.stale_logps == "sampler":  # exact PPO ratios
            rollout.old_weights = current.weights  # the ratios' old log-probs are the trainer's under these
        rollout.seconds.update(sync_s=sync["rollout/sync_s"], wait_s=waited)
        rollout.metrics |= sync
        rollout.metrics["rollout/wait_s"] = waited  # the trainer's wait for this rollout (0 when sampling kept up)
        rollout.metrics["rollout/staleness"] = float(at.step - current.version)  # updates since its weights
        return rollout

    def _sample_ahead(self, at: At) -> dict[str, float]:
        """Push the weights this epoch trains from and start sampling the next rollout from them; the sync's metrics."""
        drawn_at = self.feed.position
        prompts, prompt_ids = self._draw(at)
        sync = self._push(at, prompts, prompt_ids)
        keep = self.settings.stale_logps == "sampler"  # the weights that will score it
        weights = self.policy.trainable_weights() if keep else {}
        pending = PendingRollout(prompts, prompt_ids, drawn_at, at.step, weights)
        n, seed, tokenizer = self.settings.group_size, self._seed(at, AHEAD), self.policy.tokenizer
        self.ahead.append(self.sampler.start_apart(pending, n, self.sampling, seed, tokenizer))
        return sync

    @override
    def finish_sampling(self) -> None:
        for pending in self.ahead:  # a rollout sampling in the background finishes on the weights it started with
            pending.wait()

    def _next_to_train(self) -> tuple[PendingRollout | SavedRollout | None, int | None]:
        """The rollout a resumed run trains next, and the stream position it resumes at.

        After this rollout's steps started, that is the one sampling meanwhile; before, this one, which then runs
        again, drawing its successor again from where it was drawn.
        """
        if self.current is not None and not self.steps_started:
            return self.current, self.ahead[0].drawn_at if self.ahead else self.feed.position
        return (self.ahead[0] if self.ahead else self._saved), None

    @override
    def state_dict(self) -> dict:
        """Also every process's rollout a resumed run trains next, scored (``rollout/saved.py``).

        Every process must call it: it waits for that rollout's sampling to finish, and rank 0 writes them all.
        """
        state = super().state_dict()
        rollout, cursor = self._next_to_train()
        if self.ahead and rollout is self.ahead[0]:
            rollout.score(self.rewards, self.settings.reward_warn_s)  # this run and a resumed one train these scores
        state["pending"] = gather_saved(rollout.state() if rollout else None, not self.policy.sharded)
        if cursor is not None:
            state["cursor"] = cursor
        return state

    @override
    def load_state_dict(self, state: dict, at: At) -> None:
        super().load_state_dict(state, at)
        self.current = None
        self.ahead.clear()

    def _restore_saved(self, at: At) -> PendingRollout | None:
        """The rollout a checkpoint held, its prompts drawn again from where they were drawn."""
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        self.feed.position = saved.drawn_at
        prompts, prompt_ids = self._draw(at)
        return restore(saved, prompts, prompt_ids, at.rank, at.ranks, at.max_over_processes)
