"""A rollout sampled in the background while the policy trains (``data.rollout.max_staleness`` >= 1).

With ``max_staleness`` 1 the data module starts rollout k + 1 on the engine (which runs in its own process) right
after pushing the weights that rollout k trains from, and trains on rollout k meanwhile. Rollout k + 1 is then
sampled from weights one rollout older than those it trains: its ``PendingRollout`` keeps those weights (the trainable
ones, ``Policy.trainable_weights``), so the trainer's log-probs of its tokens under them become the old log-probs of
the policy ratio (``RolloutBatch.old_logps``), exactly as for any off-policy step.

A checkpoint holds the pending rollout whole (its completions, its policy version and those weights) and scored (its
rewards, so a resumed run never asks a judge or a reward model again), one per process (``loop/saved.py``), so a
resumed run trains on the same rollout, with the same ratios and rewards, as an uninterrupted one; with
``max_staleness`` N, every one of the N sampling ahead.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion, Episode
from amir_lightning.loop.rewarding import Scores
from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.inputs import RunState


@dataclass(frozen=True)
class Sampled:
    """What a rollout's sampling thread returns: its completions, how long sampling took and when it ended."""

    completions: list[list[Completion]]
    generate_s: float
    finished_at: float


@dataclass
class PendingRollout:
    """A rollout drawn and sampling (or sampled) from an earlier policy version.

    Attributes:
        prompts: This process's prompts.
        prompt_ids: Their chat-templated token ids.
        drawn_at: The prompt stream's position before they were drawn (a resume draws them again from there).
        version: The optimisation step whose weights sampled it (``trainer.global_step`` at the push).
        weights: Those weights, the trainable ones (``Policy.trainable_weights``; empty when they are not needed).
        run_state: Where the run stood when its sampling started (the rewards' ``trainer_state``).
        started: ``time.perf_counter()`` when sampling started.
        generate_s: How long sampling took.
        finished_at: ``time.perf_counter()`` when sampling finished.
        completions: What it sampled, once ``wait`` has returned.
        scores: Its rewards, once ``score`` has run.
    """

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    drawn_at: int
    version: int
    weights: dict[str, torch.Tensor]
    run_state: RunState = field(default_factory=RunState)
    started: float = field(default_factory=time.perf_counter)
    generate_s: float = 0.0
    finished_at: float | None = None
    completions: list[list[Completion]] | None = None
    scores: Scores | None = None
    sampling: Future[Sampled] | None = field(default=None, repr=False)

    def sampled(self, completions: list[list[Completion]], generate_s: float) -> PendingRollout:
        """This rollout with its completions, sampled in ``generate_s`` seconds in the training thread."""
        return replace(self, completions=completions, generate_s=generate_s, finished_at=time.perf_counter())

    def wait(self) -> list[list[Completion]]:
        """Its completions, once sampled (an error of the engine is raised here, in the training thread).

        ``wait`` and ``score`` are the only writers of a pending rollout after it is built: they keep what its
        sampling thread returned (``Sampled``) and its rewards, once.
        """
        if self.completions is None:
            done = self.sampling.result()
            self.completions, self.generate_s, self.finished_at = done.completions, done.generate_s, done.finished_at
            self.sampling = None
        return self.completions

    def score(self, rewards: list[Reward], warn_s: float) -> Scores:
        """Its rewards (``Scores.of``), computed once: the run trains on these, and a checkpoint keeps them.

        Args:
            rewards: The run's rewards (``data.rewards``).
            warn_s: ``data.rollout.reward_warn_s``.

        Returns:
            The scores of its completions (waits for sampling to finish).
        """
        if self.scores is None:
            self.scores = Scores.of(rewards, self.prompts, self.wait(), warn_s, self.run_state)
        return self.scores

    def state(self) -> dict:
        """Plain data for a checkpoint (waits for sampling to finish); its scores when ``score`` has run."""
        completions, digest = self.wait(), prompt_digest(self.prompt_ids)
        return SavedRollout(
            self.drawn_at, self.version, self.weights, self.generate_s, completions, digest, self.scores, self.run_state
        ).state()


def prompt_digest(prompt_ids: list[list[int]]) -> str:
    """A fingerprint of a process's chat-templated prompts: a resume checks its completions belong to them."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()


@dataclass
class SavedRollout:
    """A pending rollout as a checkpoint holds it: redrawn from ``drawn_at``, its completions as sampled.

    ``prompt_digest`` fingerprints the prompts it was sampled for (``None`` in checkpoints older than it), and
    ``scores`` are its rewards when they were computed before the checkpoint, and ``run_state`` the rewards'
    ``trainer_state`` (from an older checkpoint: its step and nothing else).
    """

    drawn_at: int
    version: int
    weights: dict[str, torch.Tensor]
    generate_s: float
    completions: list[list[Completion]]
    prompt_digest: str | None = None
    scores: Scores | None = None
    run_state: RunState | None = None

    def __post_init__(self) -> None:
        if self.run_state is None:  # an older checkpoint: its step is all that is known
            self.run_state = RunState(global_step=self.version)

    def state(self) -> dict:
        """What ``from_state`` reads."""
        completions = [[asdict(c) for c in group] for group in self.completions]
        return {
            "drawn_at": self.drawn_at,
            "version": self.version,
            "weights": self.weights,
            "generate_s": self.generate_s,
            "completions": completions,
            "prompt_digest": self.prompt_digest,
            "scores": None if self.scores is None else dict(vars(self.scores)),
            "run_state": None if self.run_state is None else asdict(self.run_state),
        }

    @classmethod
    def from_state(cls, state: dict) -> SavedRollout:  # noqa: D102
        groups = [[_completion(c) for c in group] for group in state["completions"]]
        scores = Scores(**state["scores"]) if state.get("scores") is not None else None
        when = int(state["drawn_at"]), int(state["version"])
        run = RunState(**state["run_state"]) if state.get("run_state") else None
        return cls(*when, state["weights"], float(state["generate_s"]), groups, state.get("prompt_digest"), scores, run)

    def fits(self, prompt_ids: list[list[int]]) -> bool:
        """Whether its completions were sampled for these prompts (their count only, in an older checkpoint)."""
        if self.prompt_digest is None:
            return len(prompt_ids) == len(self.completions)
        return prompt_digest(prompt_ids) == self.prompt_digest

    def pending(self, prompts: list[Prompt], prompt_ids: list[list[int]]) -> PendingRollout:
        """The pending rollout again, with its prompts drawn anew (the same ones: the stream is deterministic)."""
        when = self.drawn_at, self.version
        return PendingRollout(prompts, prompt_ids, *when, self.weights, self.run_state, generate_s=self.generate_s,
                              completions=self.completions, scores=self.scores)  # fmt: skip


#: The fields an episode's completion held itself in checkpoints older than ``Episode``.
EPISODE_FIELDS = {f.name for f in fields(Episode)}


def _completion(state: dict) -> Completion:
    """A completion as a checkpoint holds it (``asdict``), also as older checkpoints wrote it.

    Those named the engine's log-probs ``logprobs``, and kept each completion's ``old_logprobs`` (its log-probs under
    the rollout's kept weights): the resumed run scores those again from the weights (``batch.py``'s ``score_old``).
    Those also kept an episode's loss mask, turns, tool counts, messages and outcome beside the completion's own
    fields; they are its ``Episode`` now (a completion whose loss mask was ``None`` had none).
    """
    renamed = {"logprobs": "sampling_logps"}
    state = {renamed.get(k, k): v for k, v in state.items() if k != "old_logprobs"}
    flat = {name: state.pop(name) for name in EPISODE_FIELDS if name in state}
    episode = state.pop("episode", None)
    if episode is None and flat.get("loss_mask") is not None:
        episode = flat
    return Completion(**state, episode=Episode(**episode) if episode is not None else None)
