"""Policy: the model being trained, as the rollout side sees it.

The rollout side needs four things of the policy: the files an engine starts from and the tokenizer (``model_dir``,
``tokenizer``), the weights to push into the engine (``export_weights``), and scoring without gradient: the probe of
the weight sync (``score_tokens``) and the old policy's log-probs of off-policy steps and evaluation (``logps``).
It scores token tensors (``input_ids``, ``attention_mask``, the completion width), never a batch of the loop, so the
models room imports nothing above it.
``AmirGRPOModule`` owns one and hands it to the data module once (``RolloutDataModule.attach``), so neither side
reaches into the other, or through the trainer, mid-rollout. The module's own forward passes (with gradient, and of
the reference) go through ``completion_logps`` too, so every log-prob of a run is computed one way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch

from amir_lightning.helpers.distributed import rank_zero_first
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.loading import (
    LoraSettings,
    adapter_state,
    is_peft,
    is_sharded,
    load_policy,
    load_reference,
    merged_state,
    shard_fsdp2,
)
from amir_lightning.models.scoring import (
    autocast,
    completion_logps,
    fused_head_allowed,
    sequence_token_logps,
    varlen_attention,
)
from amir_lightning.models.sharded import _local, fill_shards, materialize, plan_sharded_start, reshard
from amir_lightning.models.sources import ModelSource

log = logging.getLogger(__name__)


@dataclass
class ScoringSettings:
    """How the policy's log-probs are computed (``model.scoring``).

    Attributes:
        chunk_size: Completion tokens whose ``[tokens, V]`` logits exist at once (memory against speed).
        fused_head: Fuse the LM head with the log-softmax (``chosen_token_logps``): the ``[n, T, V]`` logits never
            exist and padding is skipped past the decoder. Off: the logits of the completion positions are
            materialised (the path of TRL and the official code).
        packing: Score each micro-batch as one row of its real tokens back to back, without padding (position ids
            restart at each sequence). ``auto``: where the attention runs each sequence alone
            (``attn_implementation`` ``varlen`` or ``flash_attention_2``/``3``); ``on``: also under SDPA and eager,
            which attend through a block-diagonal mask (exact, but attention then spans the whole pack); ``off``:
            pad. Needs the fused head.
        attn_implementation: The policy's attention kernels: ``varlen`` (PyTorch's variable-length flash
            attention for packed rows on a GPU, SDPA elsewhere: ``amir_lightning.models.attention``) or a Hugging
            Face name (``sdpa``, ``eager``, ``flash_attention_2``...); ``None``: transformers' default (SDPA).
        entropy: Log the mean token entropy, ``train/entropy`` (from the fused head's chunks: no extra pass; one
            more softmax pass over the vocabulary on the materialised path).
    """

    chunk_size: int = 512
    fused_head: bool = True
    packing: Literal["auto", "on", "off"] = "auto"
    attn_implementation: str | None = None
    entropy: bool = True

    def __post_init__(self) -> None:
        errors: list[str] = []
        check_number(errors, "model.scoring.chunk_size", self.chunk_size, ge=1)
        if self.packing not in ("auto", "on", "off"):
            errors.append(f"model.scoring.packing must be auto, on or off, got {self.packing!r}")
        elif self.packing == "on" and not self.fused_head:
            errors.append("model.scoring.packing: on needs model.scoring.fused_head: true (it scores packed rows)")
        raise_errors(errors)


class Policy:
    """The trained policy's files, tokenizer, weights and scoring.

    Args:
        source: Where the initial policy comes from (resolved to a local directory once, by rank 0 first).
        temperature: Temperature of the training log-probs (the sampling temperature).
        scoring: How log-probs are computed (chunks, fused head, packing, attention).
        lora: The LoRA adapters the policy trains (``model.lora``; ``None``: every weight trains).
    """

    def __init__(
        self,
        source: ModelSource,
        temperature: float = 1.0,
        scoring: ScoringSettings | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.source, self.temperature, self.lora = source, temperature, lora
        self.scoring = scoring or ScoringSettings()
        self.model: torch.nn.Module | None = None  # set by ``build`` (or ``bind``)
        self.reference_copy: torch.nn.Module | None = None  # a frozen copy, when the loss needs a reference
        self.compute_dtype = torch.float32
        self.cast_by_autocast = True  # False under FSDP2, which casts the parameters for compute itself
        self.fused = self.packed = False
        self.sharded = False  # whether ``build`` sharded the policy with FSDP2

    @cached_property
    def model_dir(self) -> Path:
        """Local directory of the initial policy: what the engine loads first."""
        return Path(rank_zero_first(self.source.resolve))

    @cached_property
    def tokenizer(self):
        """The policy's tokenizer."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=self.source.trust_remote_code)

    @property
    def pad_token_id(self) -> int:
        """Padding id (the EOS id when the tokenizer has no pad token)."""
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def build(
        self,
        compute_dtype: torch.dtype,
        frozen_dtype: torch.dtype | None = None,
        trainable_dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        mesh=None,
        with_reference: bool = False,
    ) -> torch.nn.Module:
        """Load the policy from ``model_dir``, decide how it scores (``bind``), and shard it with FSDP2 on ``mesh``.

        Frozen weights (the LoRA base) are stored in ``frozen_dtype``, default the compute dtype; trainable ones in
        ``trainable_dtype``. ``with_reference``: also load a frozen copy of the initial policy, unless the policy has
        LoRA adapters (its reference is then the policy with them disabled: no second copy).
        """
        trust, attention = self.source.trust_remote_code, self.scoring.attn_implementation
        frozen = frozen_dtype or compute_dtype
        settings = (self.model_dir, frozen, trainable_dtype, gradient_checkpointing, lora, trust, attention)
        start = None
        if mesh is not None:  # each process reads its own rows of the checkpoint (models/sharded.py)
            drawn_from = torch.get_rng_state()
            model = load_policy(*settings, on_meta=True)
            start = plan_sharded_start(model, self.model_dir)
            if start.reason is not None:
                log.info("model: %s; every process loads the whole policy before sharding it", start.reason)
                start = None
                torch.set_rng_state(drawn_from)  # LoRA's factors are drawn again, from where they were
        if start is None:
            model = load_policy(*settings)
        model.train()  # dropout is off in the model itself (load_policy), so train mode computes what eval mode does
        if mesh is not None:
            shard_fsdp2(model, mesh.device_type, compute_dtype)  # in place: ``self.model`` is the sharded one
            self.sharded = True
        if start is not None:
            materialize(model, _mesh_device(mesh.device_type))
            fill_shards(model, start, frozen if lora is not None else trainable_dtype)
        self.bind(model, compute_dtype, mesh is None)  # its head check is a forward: a collective under FSDP2
        if mesh is not None:
            reshard(model)  # the root keeps what that forward gathered
        if with_reference and not is_peft(model):
            # The copy computes as the policy does at step 0, so it is stored as the policy is. Under autocast a
            # float32 policy keeps its residual stream and norms in float32 while a bf16 copy rounds them (up to
            # 0.004 nat per token on a 2-layer tiny model, more with depth: a KL floor and noise in the pair margins
            # at step 0; tests/test_precision.py). FSDP2 casts the policy's parameters to the compute dtype, so
            # there the copy is stored in it. ``model.dtype`` set by name wins (half the memory, with that floor).
            dtype = frozen_dtype or (compute_dtype if mesh is not None else trainable_dtype)
            copy = None if mesh is None else self._sharded_reference(dtype, compute_dtype, mesh.device_type)
            self.reference_copy = copy if copy is not None else load_reference(self.model_dir, dtype, trust, attention)
        return model

    def _sharded_reference(
        self, dtype: torch.dtype, compute_dtype: torch.dtype, device_type: str
    ) -> torch.nn.Module | None:
        """The frozen copy as FSDP2 shards, each process reading its own rows of the checkpoint as the policy did.

        ``None`` where the checkpoint cannot be read so (the reason is logged; the copy is then loaded whole).
        """
        trust, attention = self.source.trust_remote_code, self.scoring.attn_implementation
        copy = load_policy(self.model_dir, dtype, dtype, False, None, trust, attention, on_meta=True)
        start = plan_sharded_start(copy, self.model_dir)
        if start.reason is not None:
            log.info("model: %s; every process loads the whole reference copy", start.reason)
            return None
        shard_fsdp2(copy, device_type, compute_dtype)
        materialize(copy, _mesh_device(device_type))
        fill_shards(copy, start, dtype)
        return copy.eval().requires_grad_(False)

    @contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy: the frozen copy, or the policy with its LoRA adapters disabled."""
        if self.reference_copy is not None:
            try:
                yield self.reference_copy
            finally:
                if is_sharded(self.reference_copy):
                    reshard(self.reference_copy)  # what its forward gathered, freed (it has no backward)
        else:
            with self.model.disable_adapter():
                yield self.model

    def bind(self, model: torch.nn.Module, compute_dtype: torch.dtype, cast_by_autocast: bool) -> None:
        """Score with ``model``, under autocast to ``compute_dtype`` unless FSDP2 casts (``cast_by_autocast`` off).

        Decides the head and the rows: the fused head where the model's head allows it (``fused_head_allowed``),
        packed rows where ``scoring.packing`` asks and the attention runs each sequence alone (``auto``) or always
        (``on``).
        """
        self.model, self.compute_dtype, self.cast_by_autocast = model, compute_dtype, cast_by_autocast
        packing = self.scoring.packing
        self.fused = self.scoring.fused_head and fused_head_allowed(model, packing == "on")
        self.packed = self.fused and (packing == "on" or (packing == "auto" and varlen_attention(model)))

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters are (a shard's device under FSDP2)."""
        return next(self.model.parameters()).device

    def compute_context(self):
        """Where every forward of the policy runs: ``torch.autocast`` to the compute dtype unless FSDP2 casts."""
        return autocast(self.device, self.compute_dtype, enabled=self.cast_by_autocast)

    def completion_logps(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int,
        temperature: float,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, T]`` log-probs of the completion tokens (and their entropies) from one forward of ``model``.

        ``input_ids`` and ``attention_mask`` are ``[n, P + T]``, the completion their last ``T = completion_width``.
        """
        with self.compute_context():
            return completion_logps(
                model,
                input_ids,
                attention_mask,
                completion_width,
                temperature,
                self.scoring.chunk_size,
                entropy,
                self.fused,
                self.packed,
            )

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        """The policy in eval mode, as the engine that samples it (the same function: it is built without dropout)."""
        training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)

    @torch.no_grad()
    def logps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_width: int,
        temperature: float | None = None,
    ) -> torch.Tensor:
        """``[n, T]`` log-probs of the completion tokens under the current weights, no gradient, on the CPU.

        The old policy of off-policy steps (taken before the rollout's first update) and evaluation's scores. Under
        FSDP2 the forward is a collective: every process calls it as often.
        """
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        with self.eval_mode():
            return self.completion_logps(self.model, ids, mask, completion_width, temperature or self.temperature)[
                0
            ].cpu()

    @torch.no_grad()
    def score_tokens(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Log-probs at temperature 1 of ``completion`` after ``prompt`` (the weight-sync probe)."""
        with self.compute_context(), self.eval_mode():
            return sequence_token_logps(self.model, prompt, completion, self.device)

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights that train (LoRA's adapters only; this process's shards under FSDP2).

        The frozen ones never change, so this is the policy's version: ``swapped`` scores with it later.
        """
        return {name: _local(p).detach().to("cpu", copy=True) for name, p in self._trainable()}

    @contextmanager
    def swapped(self, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """The policy with ``weights`` (``trainable_weights``'s) in place of its own, put back on exit."""
        own = self.trainable_weights()
        params = dict(self._trainable())
        with torch.no_grad():
            for name, value in weights.items():
                _local(params[name]).copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in own.items():
                    _local(params[name]).copy_(value)

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    @contextmanager
    def export_weights(self, merged: bool = True) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
        """The policy's full weights under Hugging Face names, for the rollout engine, LoRA merged in.

        ``merged`` off: the base weights alone, for an engine that takes the adapters apart.
        """
        with merged_state(self.model, merged) as named:
            yield named

    def export_adapters(self) -> dict[str, torch.Tensor]:
        """The LoRA factors, ``B`` scaled to serve with scale 1 (``models.loading.adapter_state``)."""
        return adapter_state(self.model)


def _mesh_device(device_type: str) -> torch.device:
    """This process's device of a mesh of ``device_type`` (its current accelerator, or the CPU)."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())
