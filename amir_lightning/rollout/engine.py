"""The rollout-engine seam: generation with per-token sampling log-probs, weight loading, and probe scoring."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.rollout.digest import ColumnSample, Reading, WeightSlot


@dataclass
class SamplingConfig:
    """How completions are sampled.

    Attributes:
        temperature: Sampling temperature; the trainer's log-probs use the same one.
        top_p: Nucleus sampling threshold (1.0 = off). The trainer's log-probs ignore it, as TRL's do.
        top_k: Top-k truncation (0 = off).
        max_new_tokens: Completion length limit; a completion that reaches it is ``truncated``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "sampling.temperature", self.temperature, gt=0)
        if not 0 < self.top_p <= 1:
            errors.append(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        check_number(errors, "sampling.top_k", self.top_k, ge=0)
        check_number(errors, "sampling.max_new_tokens", self.max_new_tokens, ge=1)
        raise_errors(errors)


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: Generated tokens, including the EOS token when generation stopped on it.
        text: Decoded text (special tokens skipped).
        logprobs: Per-token log-probabilities under the sampling distribution (temperature applied).
        finish_reason: ``stop`` (EOS) or ``length`` (hit ``max_new_tokens``).
        old_logprobs: The trainer's log-probs of the tokens under the weights that sampled them, when the trainer
            has moved on since (``data.rollout.max_staleness``); ``None``: the trainer's current weights sampled.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    old_logprobs: list[float] | None = None

    @property
    def truncated(self) -> bool:
        """Whether the completion was cut by the length limit."""
        return self.finish_reason == "length"


class WeightLayout(ABC):
    """Maps the trainer's parameter names (Hugging Face's) to where an engine keeps them."""

    @abstractmethod
    def slot(self, name: str) -> WeightSlot | None:
        """Where the engine keeps the pushed tensor ``name``; ``None``: it keeps no copy of it."""


class RolloutEngine(ABC):
    """Generates completions for the trainer and follows its weights."""

    #: Whether the engine generates in a process of its own, so a rollout can be sampled while the policy trains
    #: (``data.rollout.max_staleness``); its ``generate`` then takes the rollout's ``seed``.
    runs_apart: bool = False

    @abstractmethod
    def start(self, model_dir: Path, seed: int, device: torch.device | None = None, local_rank: int = 0) -> None:
        """Load the policy from ``model_dir`` (a Hugging Face directory); called once before generating.

        ``device`` is the training process's own (Lightning's ``strategy.root_device``) and ``local_rank`` its rank
        on its node (``trainer.local_rank``, whatever the launcher: torchrun's ``LOCAL_RANK``, SLURM's
        ``SLURM_LOCALID``); an engine inside the process uses them instead of guessing from the environment.
        """

    @abstractmethod
    def generate(self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig) -> list[list[Completion]]:
        """``n`` completions for each tokenised prompt, in prompt order."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with the trainer's (Hugging Face parameter names)."""

    @abstractmethod
    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Log-probabilities (temperature 1) of ``completion`` after ``prompt``: the weight-sync probe."""

    def weight_layout(self) -> WeightLayout | None:
        """Where the engine keeps each pushed tensor, for the exact sync check (``rollout/sync.py``).

        ``None`` (the default): the engine cannot say, and its syncs are checked by the probe alone.
        """
        return None

    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]] | None:
        """Digests of the weights the engine holds now, read back from the engine itself, by ``WeightSlot.key``.

        A key may have several readings (a parameter and a kernel's packed copy of it, which is read on
        ``columns``); each must equal the digest of what was pushed. ``None`` (the default): the engine cannot read
        its weights back.
        """
        del columns
        return None

    def sleep(self) -> None:  # noqa: B027 (optional hook)
        """Release the engine's device memory while the policy trains (the next use takes it back); default: keep it."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the engine."""

    @property
    def started(self) -> bool:
        """Whether ``start`` has run."""
        return getattr(self, "_started", False)
