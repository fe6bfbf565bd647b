"""Exact digests of weights: what the trainer pushed against what the rollout engine holds, whatever its layout.

An engine does not hold the trainer's tensors as they are: vLLM fuses ``q_proj``, ``k_proj`` and ``v_proj`` into one
``qkv_proj`` (and ``gate_proj`` and ``up_proj``), pads the vocabulary to a multiple of 64 with zeros, shares one
tensor between tied embeddings and the LM head, and on CPU repacks linear weights into its GEMM kernels' own
layout. So a digest is a sum over the *multiset* of a tensor's elements:

    digest(t) = (sum_j bits(t_j), sum_j mix(bits(t_j)))      bits: the element's IEEE bit pattern as an integer

Both sums ignore order, so the digest of a fused tensor is the sum of its parts' digests, and a transposed or
repacked copy has the digest of the original. A zero element adds nothing, so padding is invisible. The second sum
passes each bit pattern through a multiplicative mixer, so differences that cancel in the plain sum (two elements
swapping values between tensors, one element up and another down by the same bits) still show. The arithmetic is
int32 with wrap-around and int64 sums: exact, identical on CPU and GPU; two different weight sets share a digest
only by a collision of two 64-bit sums.

``-0.0`` counts as ``+0.0``: a copy read back through a matrix product (vLLM's CPU kernels) cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Elements digested at once (bounds the temporary int32 tensors to 64 MiB each).
_CHUNK = 1 << 24
_MIX_1, _MIX_2 = 0x2545F491, 0x1B873593
_MASK = (1 << 64) - 1
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Digest:
    """The order-free digest of a multiset of tensor elements; digests of disjoint parts add."""

    plain: int = 0
    mixed: int = 0

    def __add__(self, other: Digest) -> Digest:
        return Digest((self.plain + other.plain) & _MASK, (self.mixed + other.mixed) & _MASK)


def tensor_digest(tensor: torch.Tensor) -> Digest:
    """The digest of ``tensor``'s elements, as stored (cast first to compare with another dtype's copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.element_size() == 8:  # float64 / int64: two 32-bit words per element
        flat = flat.view(torch.int32)
    plain = mixed = 0
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK]
        if part.is_floating_point():
            part = part + 0  # -0.0 + 0.0 == +0.0
        bits = part.contiguous().view(_BITS[part.element_size()]).to(torch.int32)
        mix = bits * _MIX_1
        mix ^= mix >> 15
        mix *= _MIX_2
        mix ^= mix >> 13
        plain += int(bits.sum(dtype=torch.int64))
        mixed += int(mix.sum(dtype=torch.int64))
    return Digest(plain & _MASK, mixed & _MASK)


@dataclass(frozen=True)
class WeightSlot:
    """Where the engine keeps one pushed tensor.

    Attributes:
        key: The engine's tensor that holds it (its first name, when several names share one tensor).
        part: Which part of ``key`` it fills (``q``, ``k``, ``v`` of a fused ``qkv_proj``); ``""``: all of it. Two
            pushed tensors for the same part (tied embeddings) must be equal.
        dtype: The dtype the engine stores it in.
        load_dtype: A narrower dtype the engine may load it through before keeping it in ``dtype`` (vLLM's CPU
            kernels keep a bf16 model's biases in float32: rounded to bf16 at the first load, not at a reload);
            ``None``: none.
    """

    key: str
    part: str
    dtype: torch.dtype
    load_dtype: torch.dtype | None = None

    def digests(self, tensor: torch.Tensor) -> tuple[Digest, ...]:
        """The digests ``tensor`` may have in the engine: cast to ``dtype``, and through ``load_dtype`` if set."""
        direct = tensor_digest(tensor.to(self.dtype))
        if self.load_dtype is None:
            return (direct,)
        return direct, tensor_digest(tensor.to(self.load_dtype).to(self.dtype))
