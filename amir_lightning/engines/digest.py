"""Exact digests of weights that know where each element is: what the trainer pushed against what the engine holds.

An engine does not hold the trainer's tensors as they are: vLLM fuses ``q_proj``, ``k_proj`` and ``v_proj`` into one
``qkv_proj`` (and ``gate_proj`` and ``up_proj``), pads the vocabulary with zero rows, shares one tensor between
tied embeddings and the LM head, splits tensors over tensor-parallel workers, and on CPU repacks linear weights into
its GEMM kernels' own layout. So every element is digested at its place in the *frame* of the engine tensor it
belongs to, the full (unsharded, fused) tensor as a matrix of ``width`` columns, wherever it is stored:

    digest(t) = (sum_j mix(j, b_j), sum_j b_j)  mod 2^32       b_j: the IEEE bits of the element at frame index j
    mix(j, b) = fmix(b * (1 + 2 G j))         fmix: xor-shift, multiply, xor-shift (murmur3's finaliser, shortened)

The sums add over disjoint blocks, so a fused tensor's digest is the sum of its parts' digests at their row offsets
(q, k, v; gate, up) and a sharded tensor's the sum of its shards' at theirs; a block read through a kernel (the
columns it reads, placed back at their frame columns) has the digest of the same block stored plainly. ``mix`` of a
zero element is zero, so padding is invisible. A digest of sampled columns counts ``-0.0`` as ``+0.0`` (a copy read
back through a matrix product cannot tell them apart); a whole tensor's digest sees the sign of a zero too.

What it sees: any change of a value or of a place within the frame: a transposed square weight, heads or rotary rows
in another order, k and v or gate and up exchanged inside a fused tensor, shards in another order, a sign flip of
any number of elements. A wrong weight set passes only by a collision of the 32-bit mixed sum (chance about 2^-32
per tensor and sync; frame indices are distinct below 2^31 elements per tensor). What it cannot see: a layout the
engine reports wrongly about itself (a fused tensor whose parts the engine's own code reads at other offsets than it
declares), and anything outside the weights (the engine's code, its configuration): the probe measures those.

The arithmetic is int32 with wrap-around, exact and the same on CPU and GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

#: Elements digested at once (bounds the temporary tensors to 16 MiB each).
_CHUNK = 1 << 22
_MASK = (1 << 32) - 1
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_GOLDEN = 0x9E3779B1  # 2^32 / golden ratio: consecutive indices get multipliers far apart
_MURMUR = 0x85EBCA6B - (1 << 32)  # murmur3's first finaliser constant, as an int32


@dataclass(frozen=True)
class Digest:
    """The digest of a set of placed tensor elements; digests of disjoint blocks add."""

    mixed: int = 0
    plain: int = 0

    def __add__(self, other: Digest) -> Digest:
        return Digest((self.mixed + other.mixed) & _MASK, (self.plain + other.plain) & _MASK)


@dataclass(frozen=True)
class Place:
    """Where a block of a tensor sits in its frame (the full engine tensor, as a matrix).

    Attributes:
        row: The frame row of the block's first row (a fused part's offset, a shard's).
        col: The frame column of its first column (a row-parallel shard's).
        width: The frame's columns; ``None``: the block's own (1 for a vector).
    """

    row: int = 0
    col: int = 0
    width: int | None = None


def tensor_digest(tensor: torch.Tensor, place: Place | None = None, columns: torch.Tensor | None = None) -> Digest:
    """The digest of ``tensor``'s elements at their places, as stored (cast first to compare with another dtype).

    Args:
        tensor: A matrix or a vector (a vector is one column); other shapes are read as ``[rows, -1]``.
        place: Where ``tensor`` sits in its frame; ``None``: it is the whole frame.
        columns: The frame columns of ``tensor``'s columns (the sampled columns of a kernel read-back, where
            ``-0.0`` counts as ``+0.0``); ``None``: consecutive from ``place.col``.
    """
    place = place or Place()
    t = tensor.detach()
    if not t.numel():
        return Digest()
    t = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)
    width = place.width or t.shape[1]
    cols = columns.to(torch.int64) if columns is not None else torch.arange(t.shape[1]) + place.col
    words = 2 if t.element_size() == 8 else 1  # float64 / int64: two 32-bit words per element, two frame slots
    if words == 2:
        cols = (words * cols[:, None] + torch.arange(2)).reshape(-1)
    col_term = _as_int32(1 + 2 * _GOLDEN * cols).to(t.device)[None, :]
    step = max(1, _CHUNK // max(1, t.shape[1]))
    mixed = plain = 0
    for start in range(0, t.shape[0], step):
        part = t[start : start + step]
        part = part + 0 if columns is not None and part.is_floating_point() else part  # -0.0 + 0.0 == +0.0
        bits = part.contiguous().view(_BITS[part.element_size()]).to(torch.int32)
        rows = torch.arange(start, start + part.shape[0]) + place.row
        row_term = _as_int32(2 * _GOLDEN * words * width * rows).to(t.device)[:, None]
        plain += int(bits.sum(dtype=torch.int32))
        mixed += int(_mix(bits, row_term + col_term).sum(dtype=torch.int32))
    return Digest(mixed & _MASK, plain & _MASK)


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 values modulo 2^32 as int32 (two's complement), for int32 arithmetic that wraps."""
    values = values % (1 << 32)
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def _mix(bits: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    """``fmix(bits * multipliers)`` element-wise, in ``multipliers`` (int32; the shifts are logical)."""
    h = multipliers.mul_(bits)  # odd multipliers: a bijection of the bits at each place; 0 stays 0
    shifted = torch.bitwise_right_shift(h, 15).bitwise_and_(0x1FFFF)  # the sign bit reaches the low half
    h.bitwise_xor_(shifted).mul_(_MURMUR)
    torch.bitwise_right_shift(h, 13, out=shifted).bitwise_and_(0x7FFFF)
    return h.bitwise_xor_(shifted)


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
        """Sorted frame indices of the columns read, of a frame ``width`` columns wide."""
        if self.count is None or self.count >= width:
            return torch.arange(width)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + width)
        return torch.randperm(width, generator=generator)[: self.count].sort().values


@dataclass(frozen=True)
class Reading:
    """One copy of a block of an engine tensor, digested: all of it, or the sampled columns (``ColumnSample``).

    Attributes:
        digest: The block's digest at its place.
        sampled: Whether it covers the sampled columns only.
        place: Where the block sits; ``None``: it is the whole tensor. Readings of one place are copies (replicated
            over tensor-parallel workers) and must agree; readings of distinct places add up to the tensor.
    """

    digest: Digest
    sampled: bool = False
    place: Place | None = None


@dataclass(frozen=True)
class WeightSlot:
    """Where the engine keeps one pushed tensor.

    Attributes:
        key: The engine's tensor that holds it (its first name, when several names share one tensor).
        part: Which part of ``key`` it fills (``q_proj``, ``k_proj``, ``v_proj`` of a fused ``qkv_proj``); ``""``:
            all of it. Two pushed tensors for the same part (tied embeddings) must be equal.
        dtype: The dtype the engine stores it in.
        load_dtype: A narrower dtype the engine may load it through before keeping it in ``dtype`` (vLLM's CPU
            kernels keep a bf16 model's biases in float32: rounded to bf16 at the first load, not at a reload);
            ``None``: none.
        kernel: The engine also keeps it packed in a kernel, read back on sampled columns.
        whole: The engine reads the tensor back whole (vLLM on CPU empties the parameters it packs into kernels).
        row: The frame row where the part starts in ``key`` (the rows of the parts before it).
    """

    key: str
    part: str
    dtype: torch.dtype
    load_dtype: torch.dtype | None = None
    kernel: bool = False
    whole: bool = True
    row: int = 0

    def digests(self, tensor: torch.Tensor, columns: ColumnSample | None = None) -> tuple[Digest, ...]:
        """The digests ``tensor`` (or its ``columns``) may have in the engine, at the part's place.

        Cast to ``dtype``, and through ``load_dtype`` if set.
        """
        place, picked = Place(self.row), None
        if columns is not None:
            picked = columns.pick(tensor.shape[1])
            place = Place(self.row, width=tensor.shape[1])
            tensor = tensor[:, picked.to(tensor.device)]
        direct = tensor_digest(tensor.to(self.dtype), place, picked)
        if self.load_dtype is None:
            return (direct,)
        return direct, tensor_digest(tensor.to(self.load_dtype).to(self.dtype), place, picked)


class WeightLayout(ABC):
    """Maps the trainer's parameter names (Hugging Face's) to where an engine keeps them."""

    @abstractmethod
    def slot(self, name: str) -> WeightSlot | None:
        """Where the engine keeps the pushed tensor ``name``; ``None``: it keeps no copy of it."""

    def adapter_place(self, module: str) -> tuple[str, int] | None:
        """The engine's LoRA layer and slice that serve the adapter of the trainer's layer ``module``.

        ``model.layers.0.self_attn.k_proj`` -> ``("model.layers.0.self_attn.qkv_proj", 1)``; ``None``: none.
        """
        del module
        return None


class PushedDigests:
    """Digests of a push, per engine tensor and part, taken as the tensors stream to the engine.

    Args:
        layout: Where the engine keeps each pushed tensor.
        columns: The columns of kernel-held weights the engine reads back at this sync.
        watched: The pushed names also digested whole as pushed (``fingerprints``), to see whether they changed
            since an earlier sync: those the engine cannot show it holds. ``None``: every name (the first sync,
            before the engine has said what it reads back).
    """

    def __init__(self, layout: WeightLayout, columns: ColumnSample, watched: set[str] | None = None) -> None:
        self.layout, self.columns, self.watched = layout, columns, watched
        self.fingerprints: dict[str, Digest] = {}  # pushed name -> digest of it whole, as pushed (``watched``)
        # engine tensor -> part -> (digests of all of it, of the sampled columns; None where not read back), each way
        # it may load
        self.parts: dict[str, dict[str, tuple[tuple[Digest, ...] | None, tuple[Digest, ...] | None]]] = {}
        self.sources: dict[str, list[str]] = {}  # engine tensor -> the pushed names that fill it
        self.conflicts: list[str] = []  # tied names pushed with different values
        self.unheld: list[str] = []  # pushed names the engine keeps no copy of
        self.dtypes: set[torch.dtype] = set()  # the dtypes the engine keeps the pushed tensors in

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Record one pushed tensor."""
        if self.watched is None or name in self.watched:
            self.fingerprints[name] = tensor_digest(tensor)
        slot: WeightSlot | None = self.layout.slot(name)
        if slot is None or not (slot.whole or slot.kernel):
            self.unheld.append(name)
            return
        self.dtypes.add(slot.dtype)
        # only the copies the engine reads back: on a CPU most weights live in kernels alone
        digests = (
            slot.digests(tensor) if slot.whole else None,
            slot.digests(tensor, self.columns) if slot.kernel else None,
        )
        parts = self.parts.setdefault(slot.key, {})
        if slot.part in parts and parts[slot.part] != digests:
            self.conflicts.append(f"{name} and {self.sources[slot.key][0]}, which both fill {slot.key}")
        parts[slot.part] = digests
        self.sources.setdefault(slot.key, []).append(name)

    def expected(self, key: str, sampled: bool) -> set[Digest]:
        """The digests the engine tensor ``key`` (or its sampled columns) may have: its parts' sum, each way."""
        found = [d[sampled] for d in self.parts[key].values() if d[sampled] is not None]
        totals = set()
        for way in range(max((len(d) for d in found), default=1)):
            total = Digest()
            for digests in found:
                total = total + digests[min(way, len(digests) - 1)]
            totals.add(total)
        return totals

    def mismatches(self, held: dict[str, list[Reading]]) -> list[str]:
        """Descriptions of every engine tensor that does not hold what was pushed, in push order.

        A tensor the push fills that the engine does not read back is not compared here: ``unread`` lists it, and
        the sync says so.
        """
        wrong = [f"the push holds different values for the tied {c}" for c in self.conflicts]
        for key in self.parts:
            readings, pushed_as = held.get(key, []), " and ".join(self.sources[key])
            unread = [w for w in (False, True) if self._digested(key, w) and not any(r.sampled == w for r in readings)]
            stale = sum(r.digest not in self.expected(key, r.sampled) for r in readings)
            if stale and not unread:
                copies = f"{stale} of its {len(readings)} copies differ; " if len(readings) > 1 else ""
                wrong.append(f"{key} ({copies}pushed as {pushed_as})")
        wrong += [f"{key}, which no pushed tensor fills" for key in held if key not in self.parts]
        return wrong

    def unread(self, held: dict[str, list[Reading]]) -> list[str]:
        """Engine tensors the push fills that the engine did not read back in every way they were digested."""
        return [
            key
            for key in self.parts
            if any(self._digested(key, w) and not any(r.sampled == w for r in held.get(key, [])) for w in (False, True))
        ]

    def unchecked(self, held: dict[str, list[Reading]]) -> list[str]:
        """The pushed names the engine cannot show it holds: it keeps no copy of them, or does not read it back."""
        return self.unheld + [name for key in self.unread(held) for name in self.sources[key]]

    def compared(self, held: dict[str, list[Reading]]) -> int:
        """The engine tensors whose read-back was compared with the push."""
        return sum(1 for key in self.parts if held.get(key))

    def _digested(self, key: str, sampled: bool) -> bool:
        return any(d[sampled] is not None for d in self.parts[key].values())


class PushStream:
    """The pushed weights on their way into the engine: each tensor counted and, with ``digests``, digested.

    Iterated by the engine as it loads (``load_weights``); what it does not read is drained by the pusher, so every
    tensor counts. ``bytes`` is what passed, in the dtypes sent.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], digests: PushedDigests | None) -> None:
        self._named, self.digests, self.bytes = iter(named), digests, 0
        self.plan = getattr(named, "plan", None)  # what it will send, where its producer knows it first

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._named)
        self.bytes += tensor.numel() * tensor.element_size()
        if self.digests is not None:
            self.digests.add(name, tensor)
        return name, tensor
