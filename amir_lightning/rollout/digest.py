"""Exact digests of weights: what the trainer pushed against what the rollout engine holds, whatever its layout.

An engine does not hold the trainer's tensors as they are: vLLM fuses ``q_proj``, ``k_proj`` and ``v_proj`` into one
``qkv_proj`` (and ``gate_proj`` and ``up_proj``), pads the vocabulary to a multiple of 64 with zeros, shares one
tensor between tied embeddings and the LM head, and on CPU repacks linear weights into its GEMM kernels' own
layout. So a digest is a sum over the *multiset* of a tensor's elements:

    digest(t) = (sum_j b_j, sum_j b_j * b_j)  mod 2^32      b_j: element j's IEEE bit pattern as an integer

Both sums ignore order, so the digest of a fused tensor is the sum of its parts' digests, and a transposed or
repacked copy has the digest of the original. A zero element adds nothing, so padding is invisible. The second sum
is not linear in the bits, so differences that cancel in the plain sum (one element's bits up by one, another's
down by one) still show. The arithmetic is int32 with wrap-around, exact and the same on CPU and GPU (and 20x
faster than int64 sums on a CPU: about 0.2 s per 100M float32 weights on one thread); two different weight sets
share a digest only by a collision of the two 32-bit sums.

``-0.0`` counts as ``+0.0``: a copy read back through a matrix product (vLLM's CPU kernels) cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Elements digested at once (bounds the temporary tensors to 16 MiB each).
_CHUNK = 1 << 22
_MASK = (1 << 32) - 1
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Digest:
    """The order-free digest of a multiset of tensor elements; digests of disjoint parts add."""

    plain: int = 0
    squares: int = 0

    def __add__(self, other: Digest) -> Digest:
        return Digest((self.plain + other.plain) & _MASK, (self.squares + other.squares) & _MASK)


def tensor_digest(tensor: torch.Tensor) -> Digest:
    """The digest of ``tensor``'s elements, as stored (cast first to compare with another dtype's copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.element_size() == 8:  # float64 / int64: two 32-bit words per element
        flat = flat.view(torch.int32)
    plain = squares = 0
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK]
        part = part + 0 if part.is_floating_point() else part.clone()  # -0.0 + 0.0 == +0.0; a copy to square
        bits = part.view(_BITS[part.element_size()])
        bits = bits if bits.dtype == torch.int32 else bits.to(torch.int32)
        plain += int(bits.sum(dtype=torch.int32))
        squares += int(bits.mul_(bits).sum(dtype=torch.int32))
    return Digest(plain & _MASK, squares & _MASK)


@dataclass(frozen=True)
class ColumnSample:
    """The input columns of a weight that a CPU kernel is read back on at one sync (``data.sync.kernel_columns``).

    Reading a kernel's weight back costs a matrix product per column, so each sync reads a fresh random choice of
    ``count`` columns (every row of them, exactly); the trainer digests the same columns of what it pushed.

    Attributes:
        seed: Chooses the columns (the sync's number: a resumed run reads the same ones).
        count: Columns per weight; ``None``: all of them.
    """

    seed: int
    count: int | None

    def pick(self, width: int) -> torch.Tensor:
        """Sorted indices of the columns read, of ``width``."""
        if self.count is None or self.count >= width:
            return torch.arange(width)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + width)
        return torch.randperm(width, generator=generator)[: self.count].sort().values


@dataclass(frozen=True)
class Reading:
    """One copy of an engine tensor, digested: all of it, or the sampled columns (``ColumnSample``)."""

    digest: Digest
    sampled: bool = False


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
        kernel: The engine also keeps it packed in a kernel, read back on sampled columns.
        whole: The engine reads the tensor back whole (vLLM on CPU empties the parameters it packs into kernels).
    """

    key: str
    part: str
    dtype: torch.dtype
    load_dtype: torch.dtype | None = None
    kernel: bool = False
    whole: bool = True

    def digests(self, tensor: torch.Tensor, columns: ColumnSample | None = None) -> tuple[Digest, ...]:
        """The digests ``tensor`` (or its ``columns``) may have in the engine.

        Cast to ``dtype``, and through ``load_dtype`` if set.
        """
        if columns is not None:
            tensor = tensor[:, columns.pick(tensor.shape[1]).to(tensor.device)]
        direct = tensor_digest(tensor.to(self.dtype))
        if self.load_dtype is None:
            return (direct,)
        return direct, tensor_digest(tensor.to(self.load_dtype).to(self.dtype))
