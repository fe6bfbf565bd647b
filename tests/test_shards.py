"""Tensor-parallel read-backs: each worker's blocks placed in the full tensor, replicated copies counted once.

The workers here are built as vLLM 0.32 shards them (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``): the layers carry the attributes vLLM's layers carry, their parameters hold the
rows (or columns) a worker of that rank loads. Their digests go through the same ``param_readings`` and
``merge_workers`` as a real engine's, and must equal what the trainer digests of the full tensors it pushes.
"""

from types import SimpleNamespace

import pytest
import torch

from amir_lightning.engines.digest import Digest, WeightSlot, tensor_digest
from amir_lightning.engines.shards import merge_workers, param_readings, part_rows

GEN = torch.Generator().manual_seed(0)
HIDDEN, HEAD = 16, 4


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


def qkv_layer(rank, tp, heads, kv_heads):
    """A ``QKVParallelLinear`` of rank ``rank``: its own q heads, the k and v heads of ``rank // replicas``."""
    replicas = max(1, tp // kv_heads)
    return SimpleNamespace(
        input_size=HIDDEN, gather_output=False, tp_size=tp, tp_rank=rank, head_size=HEAD, v_head_size=HEAD,
        total_num_heads=heads, total_num_kv_heads=kv_heads, num_heads=heads // tp,
        num_kv_heads=max(1, kv_heads // tp), num_kv_head_replicas=replicas,
    )  # fmt: skip


def qkv_shard(layer, q, k, v):
    """What vLLM loads into ``layer``'s ``qkv_proj`` from the full q, k, v (``weight_loader`` with ``shard_rank``)."""
    kv_rank = layer.tp_rank // layer.num_kv_head_replicas
    nq, nkv = layer.num_heads * HEAD, layer.num_kv_heads * HEAD
    return torch.cat([q[layer.tp_rank * nq :][:nq], k[kv_rank * nkv :][:nkv], v[kv_rank * nkv :][:nkv]])


def pushed(parts: dict[str, torch.Tensor], layer) -> Digest:
    """The trainer's digest of a fused tensor: each pushed part at the row where the layer's layout starts it."""
    starts = part_rows(layer) or [0]
    return sum((WeightSlot("w", n, torch.float32, row=r).digests(t)[0] for (n, t), r in zip(parts.items(), starts)),
               Digest())  # fmt: skip


def engine_digests(workers):
    """The engine's readings of one tensor from every worker's ``(layer, attr, local tensor)``."""
    return merge_workers([{"w": param_readings(layer, attr, local)} for layer, attr, local in workers])["w"]


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 2), (4, 2), (8, 2), (4, 4)], ids=lambda v: str(v))
def test_qkv_shards_add_up_to_the_push_with_kv_heads_replicated_over_ranks(tp, kv_heads):
    heads = 8
    q, k, v = randn(heads * HEAD, HIDDEN), randn(kv_heads * HEAD, HIDDEN), randn(kv_heads * HEAD, HIDDEN)
    layers = [qkv_layer(rank, tp, heads, kv_heads) for rank in range(tp)]
    readings = engine_digests([(layer, "weight", qkv_shard(layer, q, k, v)) for layer in layers])
    expected = pushed({"q_proj": q, "k_proj": k, "v_proj": v}, layers[0])
    assert expected == tensor_digest(torch.cat([q, k, v]))  # the trainer's parts, placed, are the fused tensor
    assert {r.digest for r in readings} == {expected}
    # the same shards loaded in the wrong rank order, and k and v exchanged: both seen
    wrong_order = [(layer, "weight", qkv_shard(layers[(i + 1) % tp], q, k, v)) for i, layer in enumerate(layers)]
    assert expected not in {r.digest for r in engine_digests(wrong_order)}
    swapped = engine_digests([(layer, "weight", qkv_shard(layer, q, v, k)) for layer in layers])
    assert expected not in {r.digest for r in swapped}


def test_a_replicated_kv_copy_that_differs_on_one_worker_is_seen():
    q, k, v = randn(8 * HEAD, HIDDEN), randn(2 * HEAD, HIDDEN), randn(2 * HEAD, HIDDEN)
    layers = [qkv_layer(rank, 4, 8, 2) for rank in range(4)]
    shards = [qkv_shard(layer, q, k, v) for layer in layers]
    shards[1][2 * HEAD] += 1.0  # rank 1's copy of kv head 0 (rank 0 holds the other copy)
    digests = [r.digest for r in engine_digests([(layer, "weight", s) for layer, s in zip(layers, shards)])]
    expected = pushed({"q_proj": q, "k_proj": k, "v_proj": v}, layers[0])
    assert len(digests) == 2 and digests.count(expected) == 1  # one copy as pushed, one not: a mismatch


def test_gate_and_up_shard_each_part_and_a_row_parallel_weight_its_columns_with_the_bias_whole():
    inter, tp = 12, 2
    gate, up = randn(inter, HIDDEN), randn(inter, HIDDEN)
    fused = {"input_size": HIDDEN, "gather_output": False, "tp_size": tp, "output_sizes": [inter, inter]}
    merged = [SimpleNamespace(**fused, tp_rank=r) for r in range(tp)]
    half = inter // tp
    local = [torch.cat([gate[r * half :][:half], up[r * half :][:half]]) for r in range(tp)]
    expected = pushed({"gate_proj": gate, "up_proj": up}, merged[0])
    assert {r.digest for r in engine_digests([(m, "weight", s) for m, s in zip(merged, local)])} == {expected}
    assert expected not in {r.digest for r in engine_digests([(m, "weight", s) for m, s in zip(merged, local[::-1])])}

    down, bias = randn(HIDDEN, inter), randn(HIDDEN)
    row = [SimpleNamespace(input_size=inter, input_is_parallel=True, tp_size=tp, tp_rank=r) for r in range(tp)]
    cols = [down[:, r * half :][:, :half] for r in range(tp)]
    assert {r.digest for r in engine_digests([(m, "weight", c) for m, c in zip(row, cols)])} == {tensor_digest(down)}
    assert {r.digest for r in engine_digests([(m, "bias", bias) for m in row])} == {tensor_digest(bias)}  # once


def test_a_vocabulary_parallel_embedding_places_each_shards_tokens_and_ignores_its_padding():
    vocab, padded, tp = 10, 16, 2
    table = randn(vocab, HIDDEN)
    layers, shards = [], []
    for rank in range(tp):
        start, end = rank * padded // tp, min(vocab, (rank + 1) * padded // tp)
        indices = SimpleNamespace(org_vocab_start_index=start, num_org_elements=end - start)
        layers.append(SimpleNamespace(tp_size=tp, tp_rank=rank, shard_indices=indices, num_embeddings_padded=padded))
        shards.append(torch.cat([table[start:end], torch.zeros(padded // tp - (end - start), HIDDEN)]))
    assert {r.digest for r in engine_digests(list(zip(layers, ["weight"] * tp, shards)))} == {tensor_digest(table)}
    norm = randn(HIDDEN)  # a replicated norm weight, read on every worker: one copy counts
    held = merge_workers([{"norm": param_readings(SimpleNamespace(), "weight", norm)} for _ in range(tp)])
    assert [r.digest for r in held["norm"]] == [tensor_digest(norm)] * tp
