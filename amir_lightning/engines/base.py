"""The rollout-engine seam: generation with per-token sampling log-probs, weight loading, and probe scoring."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from amir_lightning.engines.digest import ColumnSample, Reading, WeightLayout
from amir_lightning.helpers.validation import check_number, raise_errors

#: Request seeds stay below this: vLLM adds ``j`` for a request's ``j``-th sample, and some of its paths keep the
#: seed in a signed 32-bit integer.
SEED_LIMIT = 2**30


def mix_seed(*parts: int) -> int:
    """A seed that is a hash of ``parts`` (63 bits): seeds of different parts share no arithmetic progression.

    Seeds made by adding offsets collide wherever two offsets meet (a rank's ``+ 8`` against a prompt's ``+ n``);
    hashed seeds collide only by chance. The one addition left is vLLM's own: a request's ``j``-th sample is
    seeded ``seed + j``.
    """
    data = b",".join(str(int(part)).encode() for part in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


#: A turn's place in the seed hash (``turn_seed``): after the generation's seed, before the turn's index.
TURN = 2


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of an episode's ``turn``-th turn (the first turn's is the generation's; ``None`` stays ``None``)."""
    return seed if turn == 0 or seed is None else mix_seed(seed, TURN, turn)


def request_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th prompt's request of a generation seeded ``seed`` (below ``SEED_LIMIT``).

    Its ``n`` samples are seeded ``request_seed(seed, index) + j`` by vLLM: ``n`` consecutive seeds of a range that
    starts at a hash, so two requests of a run share a seed with probability about ``2 n / SEED_LIMIT``.
    """
    return mix_seed(seed, index) % SEED_LIMIT


#: Sampling settings that are fields of ``SamplingConfig``, or that the rollout sets itself: not passed through.
RESERVED = {
    "n": "the rollout sets it (data.rollout.group_size)",
    "seed": "the rollout seeds every generation (data.seed)",
    "logprobs": "the rollout asks for the sampled tokens' log-probs",
    "prompt_logprobs": "the rollout asks for the sampled tokens' log-probs",
    "max_tokens": "set data.sampling.max_new_tokens",
    "stop_strings": "set data.sampling.stop",
}
#: Passed-through settings that change what a token is sampled from (the rest only change when generation stops or
#: how text is decoded).
SHAPING = ("logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "no_repeat_ngram_size")


@dataclass
class SamplingConfig:
    """How completions are sampled.

    The trainer's log-probs are those of the policy's softmax at ``temperature``. Every other setting that reshapes
    the distribution (``top_p``, ``top_k``, ``min_p``, the penalties, ``logit_bias`` ...) makes the engine sample from
    something else: the engine's log-probs (vLLM's, after all of them) then differ from the trainer's, and the
    mismatch correction (``model.loss.init_args.sampling_correction``) weighs each token by their ratio. The rollout
    says so once when it starts (``departures``).

    Attributes:
        temperature: Sampling temperature; the trainer's log-probs use the same one.
        top_p: Nucleus sampling threshold (1.0 = off). The trainer's log-probs ignore it, as TRL's do.
        top_k: Top-k truncation (0 = off).
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely one's (0 = off).
        repetition_penalty: Divide the logits of tokens already in the prompt or completion by it (1.0 = off).
        presence_penalty: Subtract it from the logits of tokens already generated (0 = off; vLLM engines only).
        frequency_penalty: Subtract it times the count of each token generated so far (0 = off; vLLM engines only).
        stop: Strings that end a completion (``finish_reason`` ``stop``). The tokens that wrote the string stay in
            the completion the policy trains on; the text the rewards see ends before it (as vLLM's does).
        max_new_tokens: Completion length limit; a completion that reaches it is ``truncated``.
        generation_kwargs: Any other setting of the engine's sampler, passed as it is: vLLM's ``SamplingParams``
            fields (``stop_token_ids``, ``min_tokens``, ``logit_bias``, ``ignore_eos`` ...) or, for ``HFEngine``,
            ``GenerationConfig`` fields. An unknown name stops the run at start, naming it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | None = None
    max_new_tokens: int = 256
    generation_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "sampling.temperature", self.temperature, gt=0)
        if not 0 < self.top_p <= 1:
            errors.append(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        check_number(errors, "sampling.top_k", self.top_k, ge=0)
        check_number(errors, "sampling.min_p", self.min_p, ge=0, lt=1)
        check_number(errors, "sampling.repetition_penalty", self.repetition_penalty, gt=0)
        check_number(errors, "sampling.presence_penalty", self.presence_penalty, ge=-2, le=2)
        check_number(errors, "sampling.frequency_penalty", self.frequency_penalty, ge=-2, le=2)
        check_number(errors, "sampling.max_new_tokens", self.max_new_tokens, ge=1)
        stop = self.stop
        if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
            errors.append(f"sampling.stop must be a list of non-empty strings, got {stop!r}")
        for key in self.generation_kwargs or {}:
            if key in RESERVED or key in {f.name for f in fields(self)}:
                why = RESERVED.get(key, f"set data.sampling.{key}")
                errors.append(f"sampling.generation_kwargs.{key} is not passed through: {why}")
        raise_errors(errors)

    def departures(self) -> list[str]:
        """The settings that make the engine sample from another distribution than the trainer's log-probs score."""
        given = [
            f"top_p {self.top_p:g}" if self.top_p < 1 else "",
            f"top_k {self.top_k}" if self.top_k > 0 else "",
            f"min_p {self.min_p:g}" if self.min_p > 0 else "",
            f"repetition_penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1 else "",
            f"presence_penalty {self.presence_penalty:g}" if self.presence_penalty else "",
            f"frequency_penalty {self.frequency_penalty:g}" if self.frequency_penalty else "",
        ]
        given += [f"generation_kwargs.{k}" for k in self.generation_kwargs or {} if k in SHAPING]
        return [g for g in given if g]

    def mismatch_warning(self) -> str | None:
        """What the ``departures`` do to the trainer's importance weights, said once when the rollout is set up.

        Top-p, top-k and min-p sample from the softmax p truncated to a kept set and renormalised, q = p / Z: every
        sampled token's weight p / q is then Z <= 1, the same for every token of the position, so it shrinks the
        step but cannot restore the dropped tokens' share of the gradient.
        """
        departures = self.departures()
        if not departures:
            return None
        text = (
            f"data.sampling reshapes the distribution ({', '.join(departures)}): the engine's log-probs are those of "
            "the distribution it samples from, the trainer's those of the policy's softmax at the temperature (as in "
            "TRL). Their ratio weighs every token in the mismatch correction "
            "(model.loss.init_args.sampling_correction) and rollout/engine_trainer_kl counts it."
        )
        if self.top_p < 1 or self.top_k > 0 or self.min_p > 0:
            text += (
                " With top_p/top_k/min_p the engine samples from the kept tokens renormalised, so the mismatch weight "
                "is the kept mass Z <= 1 on every token: a uniform shrinkage that cannot repair the truncation (the "
                "dropped tokens are never sampled)."
            )
        return text + (
            " Keep these off for training rollouts, or set sampling_correction: none to train on the samples as if "
            "the policy had drawn them."
        )

    def vllm_params(self) -> dict[str, Any]:
        """These settings as vLLM's ``SamplingParams`` (and its server's completion request) name them."""
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "max_tokens": self.max_new_tokens,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        return params | dict(self.generation_kwargs or {})


def check_passed_through(sampling: SamplingConfig, known: set[str], engine: str) -> None:
    """Stop with one line when ``generation_kwargs`` names a setting the engine's sampler does not have."""
    unknown = sorted(set(sampling.generation_kwargs or {}) - known)
    if unknown:
        raise ValueError(
            f"data.sampling.generation_kwargs: {engine} has no sampling setting {', '.join(map(repr, unknown))} "
            f"(it has: {', '.join(sorted(known))})"
        )


@dataclass
class Episode:
    """What a multi-turn episode adds to its completion (``amir_lightning/environments/``).

    Attributes:
        loss_mask: Per token of the completion, 1 on the policy's own tokens and 0 on an environment's reply
            (context, not trained on).
        turns: The policy's turns.
        tool_calls: How many times the environment replied (error replies included).
        tool_errors: How many of those replies were errors (``ToolError``).
        tool_truncated: How many of those replies were cut at the environment's ``max_reply_tokens``.
        tool_cut: Whether the episode was cut while calling the tool (at ``max_turns``, or out of context).
        tool_malformed: Turns whose tool call did not parse (``ToolEnvironment``).
        tool_seconds: Seconds the episode's tool calls took.
        messages: The episode as chat messages, with its ``tool_calls`` and ``tool`` turns (``ToolEnvironment``;
            rewards get these as ``completions``); ``None`` otherwise.
        calls: The calls it made: ``name``, ``arguments``, ``result``, ``error``, ``seconds`` (rewards'
            ``tool_calls``).
        outcome: The environment's own scoring of the episode where it has one (``VerifiersEnvironment``: its
            taskset's ``reward`` and its named ``rewards`` and ``metrics``), which ``EnvironmentReward`` trains on.
    """

    loss_mask: list[int]
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    tool_truncated: int = 0
    tool_cut: bool = False
    tool_malformed: int = 0
    tool_seconds: float = 0.0
    messages: list[dict[str, Any]] | None = None
    calls: list[dict[str, Any]] | None = None
    outcome: dict[str, Any] | None = None


@dataclass
class Completion:
    """One sampled completion.

    Attributes:
        token_ids: Generated tokens, including the EOS token when generation stopped on it.
        text: Decoded text (special tokens skipped).
        sampling_logps: The engine's log-probs of the sampled tokens (its sampling distribution, temperature
            applied): the loss's ``sampling_logps``.
        finish_reason: ``stop`` (EOS) or ``length`` (hit ``max_new_tokens``).
        versions: Per token, the weight version (the optimisation step that made the weights) that sampled it,
            where a completion can span pushes (``data.rollout.partial_rollouts``); ``None``: its rollout's version
            sampled every token.
        episode: What a multi-turn episode adds (its loss mask, turns, tool counts, messages, the environment's
            outcome); ``None`` for a single-turn completion.
    """

    token_ids: list[int]
    text: str
    sampling_logps: list[float]
    finish_reason: str
    versions: list[int] | None = None
    episode: Episode | None = None

    @property
    def truncated(self) -> bool:
        """Whether the completion was cut by the length limit."""
        return self.finish_reason == "length"

    @property
    def loss_mask(self) -> list[int] | None:
        """1 on the policy's own tokens, 0 on an environment's reply (``Episode.loss_mask``); ``None``: all own."""
        return self.episode.loss_mask if self.episode is not None else None

    @property
    def policy_tokens(self) -> int:
        """The policy's own tokens, those the loss trains on: the loss mask's sum (a tool's replies not counted).

        Every token count of the step (the aggregations' normalisers, the token-normalised statistics, the logged
        lengths) counts these, so an episode trains as its policy turns alone would.
        """
        if self.loss_mask is None:
            return len(self.token_ids)
        return int(sum(self.loss_mask[: len(self.token_ids)]))


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Torch's RNG forked and seeded with ``seed`` for one generation in this process (``None``: as it stands).

    The caller's random stream is untouched: the trainer's dropout-free forward and its data order do not depend on
    how many numbers a generation drew.
    """
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class RolloutEngine(ABC):
    """Generates completions for the trainer and follows its weights."""

    #: Whether the engine generates in a process of its own, so a rollout can be sampled while the policy trains
    #: (``data.rollout.max_staleness``); its ``generate`` then takes the rollout's ``seed``.
    runs_apart: bool = False
    #: Whether a push can land while requests are in flight, which go on with the new weights and say which
    #: weights sampled each token (``Completion.versions``; ``data.rollout.partial_rollouts``): such an engine's
    #: ``start`` takes ``in_flight``.
    takes_updates_in_flight: bool = False
    #: Whether pushes carry a LoRA policy's adapters, the base weights pushed once (``take_adapters``).
    takes_adapters: bool = False

    @abstractmethod
    def start(
        self, model_dir: Path, seed: int, device: torch.device | None = None, local_rank: int = 0, in_flight=False
    ) -> None:
        """Load the policy from ``model_dir`` (a Hugging Face directory); called once before generating.

        ``device`` is the training process's own (Lightning's ``strategy.root_device``) and ``local_rank`` its rank
        on its node (``trainer.local_rank``, whatever the launcher: torchrun's ``LOCAL_RANK``, SLURM's
        ``SLURM_LOCALID``); an engine inside the process uses them instead of guessing from the environment.
        ``in_flight``: pushes land with requests in flight (``data.rollout.partial_rollouts``), only asked of an
        engine that ``takes_updates_in_flight``.
        """

    @abstractmethod
    def generate(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig, seed: int | None = None
    ) -> list[list[Completion]]:
        """``n`` completions for each tokenised prompt, in prompt order, sampled from ``seed``.

        The same seed, weights and prompts give the same completions (``seeded`` for an engine that samples from
        torch's RNG in this process). ``None``: from torch's random stream as it stands.
        """

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Replace the engine's weights with the trainer's (Hugging Face parameter names).

        ``version``: the weight version they are, the optimisation step that made them; an engine that says which
        weights sampled each token (``Completion.versions``) labels the tokens they sample with it.
        """

    @abstractmethod
    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Log-probabilities (temperature 1) of ``completion`` after ``prompt``: the weight-sync probe."""

    def check_sampling(self, sampling: SamplingConfig) -> None:  # noqa: B027 (optional hook)
        """Stop with one line, before any rollout, where the engine cannot sample with ``sampling`` as given.

        Called once the engine has started, for the training and the evaluation sampling. Default: anything goes.
        """

    def weight_layout(self) -> WeightLayout | None:
        """Where the engine keeps each pushed tensor, for the exact sync check (``loop/sync.py``).

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

    def copies(self) -> list[tuple[str, Any]]:
        """Each copy of the weights the engine samples from, and its name, for the sync check to read back one by one.

        Each has ``held_weights``, ``held_adapters`` and ``score`` as the engine does. Default: the engine itself,
        unnamed; an engine of several servers gives each (``engines/replicas.py``), so every one is verified.
        """
        return [("", self)]

    def take_adapters(self, lora) -> None:  # noqa: B027 (optional hook)
        """Called before ``start`` with the policy's ``LoraSettings`` (``None``: every weight trains).

        An engine that serves LoRA adapters sets ``takes_adapters`` and then implements ``load_adapters`` and
        ``held_adapters``; by default pushes carry merged weights.
        """

    def load_adapters(self, adapters: dict[str, torch.Tensor], rank: int) -> None:
        """Serve ``adapters`` (``Policy.export_adapters``: Peft names, ``B`` pre-scaled) from now on."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapters")

    def held_adapters(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The LoRA factors the engine computes with, by its LoRA layer and slice (``engines/adapters.py``)."""
        raise NotImplementedError(f"{type(self).__name__} does not take LoRA adapters")

    def sleep(self) -> None:  # noqa: B027 (optional hook)
        """Release the engine's device memory while the policy trains (the next use takes it back); default: keep it."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release the engine."""

    @property
    def started(self) -> bool:
        """Whether ``start`` has run."""
        return getattr(self, "_started", False)
