"""Where each block of a vLLM worker's tensors sits in the full engine tensor: fused parts, shards and copies.

vLLM's linear layers (``vllm/model_executor/layers/linear.py``) shard their weights over tensor-parallel workers:

- column-parallel layers (``gather_output``) split the output rows; a fused one (``output_sizes``) splits each part
  on its own, so a worker holds ``[gate shard | up shard]``, and ``QKVParallelLinear`` holds ``[q heads | k heads |
  v heads]`` of its rank, the k and v heads of rank ``tp_rank // num_kv_head_replicas`` (replicated over ranks when
  there are fewer KV heads than ranks);
- row-parallel layers (``input_is_parallel``) split the input columns, and keep the bias whole on every worker,
  although it carries ``output_dim``;
- vocabulary-parallel embeddings and LM heads (``shard_indices``) split the vocabulary rows, each shard padded;
- everything else (norms, replicated layers) is whole on every worker.

Each worker digests its blocks at their frame places (``engines/digest.py``); ``merge_workers`` adds one copy of
each place, so a replicated block counts once and every copy must agree. Only the attributes above are read, so the
same functions place the blocks of a real worker and of a test's shards.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from amir_lightning.engines.digest import Digest, Place, Reading, tensor_digest


@dataclass(frozen=True)
class Block:
    """Rows ``start`` to ``start + rows`` of a worker's tensor, at ``place`` in the full tensor."""

    start: int
    rows: int
    place: Place


def part_rows(module: torch.nn.Module) -> list[int] | None:
    """The full tensor's row where each part of a fused layer starts (q, k, v; gate, up), or ``None``."""
    if not hasattr(module, "input_size"):  # not a linear layer (an attention module also counts its heads)
        return None
    if hasattr(module, "total_num_kv_heads"):  # QKVParallelLinear: the parts' full sizes, not the padded ones
        q, k = module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size
        return [0, q, q + k]
    sizes = getattr(module, "output_sizes", None)
    if not sizes:
        return None
    return [sum(sizes[:i]) for i in range(len(sizes))]


def blocks_of(module: torch.nn.Module, attr: str, rows: int, width: int | None) -> list[Block]:
    """The blocks of ``module``'s parameter ``attr`` (``weight``, ``bias``) that this worker holds, at their places.

    Args:
        module: The layer that owns the parameter.
        attr: The parameter's name in ``module``.
        rows: The worker's rows of it (its output rows; a vector's elements).
        width: The worker's columns of it; ``None``: a vector.
    """
    tp, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if tp == 1:
        return [Block(0, rows, Place(width=width))]
    if hasattr(module, "input_is_parallel"):  # row-parallel: the weight's columns split, the bias whole
        if attr == "bias":
            return [Block(0, rows, Place())]
        return [Block(0, rows, Place(0, rank * width, module.input_size))]
    if hasattr(module, "shard_indices"):  # vocabulary-parallel: this shard's tokens, then zero padding
        shard = module.shard_indices
        real = shard.num_org_elements
        pad = Place(module.num_embeddings_padded + rank * rows, width=width)  # past every real row: zeros
        return [Block(0, real, Place(shard.org_vocab_start_index, width=width)), Block(real, rows - real, pad)]
    if hasattr(module, "gather_output"):
        return _column_blocks(module, rank, tp, width)
    return [Block(0, rows, Place(width=width))]  # replicated


def param_readings(module: torch.nn.Module, attr: str, param: torch.Tensor) -> list[Reading]:
    """The digests of a worker's parameter, block by block at their places."""
    width = param.shape[1] if param.dim() > 1 else None
    readings = []
    for block in blocks_of(module, attr, param.shape[0], width):
        rows = param[block.start : block.start + block.rows]
        readings.append(Reading(tensor_digest(rows, block.place), False, block.place))
    return readings


def _column_blocks(module: torch.nn.Module, rank: int, tp: int, width: int | None) -> list[Block]:
    """A column-parallel layer's blocks: one shard of each fused part, or of the whole output."""
    starts = part_rows(module)
    if hasattr(module, "total_num_kv_heads"):
        kv_rank = rank // module.num_kv_head_replicas
        sizes = [
            module.num_heads * module.head_size,
            module.num_kv_heads * module.head_size,
            module.num_kv_heads * module.v_head_size,
        ]
        shard_of = [rank, kv_rank, kv_rank]
    elif starts is not None:
        sizes = [size // tp for size in module.output_sizes]
        shard_of = [rank] * len(sizes)
    else:
        starts, sizes, shard_of = [0], [module.output_size_per_partition], [rank]
    blocks, local = [], 0
    for start, size, shard in zip(starts, sizes, shard_of):
        blocks.append(Block(local, size, Place(start + shard * size, width=width)))
        local += size
    return blocks


def merge_workers(per_worker: list[dict[str, list[Reading]]]) -> dict[str, list[Reading]]:
    """One engine's readings from its workers' blocks: per tensor, the sum over its places of one copy each.

    A place read on several workers (a replicated tensor or KV head) is a set of copies: the k-th reading of the
    tensor sums the k-th copy of each place, so copies that disagree give readings that differ.
    """
    copies: dict[str, dict[tuple[bool, Place | None], list[Digest]]] = defaultdict(lambda: defaultdict(list))
    for readings in per_worker:
        for key, found in readings.items():
            for reading in found:
                copies[key][reading.sampled, reading.place].append(reading.digest)
    held: dict[str, list[Reading]] = {}
    for key, by_place in copies.items():
        for sampled in (False, True):
            places = [digests for (s, _), digests in by_place.items() if s == sampled]
            for k in range(max((len(d) for d in places), default=0)):
                total = Digest()
                for digests in places:
                    total = total + digests[min(k, len(digests) - 1)]
                held.setdefault(key, []).append(Reading(total, sampled))
    return held
