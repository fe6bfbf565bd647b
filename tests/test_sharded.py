"""The sharded start and the streamed push (``amir_lightning/models/sharded.py``), on two real FSDP2 processes (gloo):
each process reads only its rows of the checkpoint and ends with the shards a whole load then ``fully_shard`` gives,
bit for bit (LoRA's random factors included); the stream pushes what the whole state dict pushed, name for name and
bit for bit, in buckets of the bytes asked, never holding the whole model."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from amir_lightning.helpers.serving import free_port
from amir_lightning.models.loading import LoraSettings, load_policy, shard_fsdp2
from amir_lightning.models.policy import Policy
from amir_lightning.models.sharded import (
    buckets_of,
    checkpoint_files,
    parameters_on_meta,
    plan_sharded_start,
    push_plan,
    reshard,
    weight_buckets,
)
from amir_lightning.models.sources import HFModel
from amir_lightning.models.tiny import build_tiny_model

#: (LoRA, frozen dtype, checkpoint): every weight trains in float32; LoRA on a bfloat16 base (configs/qwen.yaml's
#: layout); and the same from a checkpoint without safetensors files, which every process loads whole.
CASES = {
    "full": (None, torch.float32, "tiny"),
    "lora_bf16": (LoraSettings(r=4, alpha=8), torch.bfloat16, "tiny"),
    "lora_bf16_bin": (LoraSettings(r=4, alpha=8), torch.bfloat16, "tiny_bin"),
}


def _old_merged(model) -> dict[str, torch.Tensor]:
    """What a push sent before the stream: the whole state dict on every process, LoRA merged per matrix."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    out = {}
    for key, tensor in state.items():
        if "lora_" in key:
            continue
        if ".base_layer." in key and key.endswith(".weight"):
            prefix = key[: key.index(".base_layer.")]
            layer = model.get_submodule(prefix)
            a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            tensor = (tensor.float() + (b.float() @ a.float()) * layer.scaling["default"]).to(tensor.dtype)
        out[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = tensor.detach().clone()
    return out


def _ranks(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cpu", (2,))
        results = {}
        for case, (lora, frozen, folder) in CASES.items():
            path = Path(model_dir).parent / folder
            torch.manual_seed(7)  # LoRA's factors are random: both starts draw them from the same state
            whole = load_policy(path, frozen, torch.float32, lora=lora)
            shard_fsdp2(whole, "cpu")
            torch.manual_seed(7)
            policy = Policy(HFModel(str(path)), lora=lora)
            sharded = policy.build(torch.float32, frozen, torch.float32, lora=lora, mesh=mesh)
            same = {
                name: torch.equal(p.to_local(), q.to_local()) and p.dtype == q.dtype
                for (name, p), (_, q) in zip(whole.named_parameters(), sharded.named_parameters(), strict=True)
            }
            buffers = all(torch.equal(a, b) for a, b in zip(whole.buffers(), sharded.buffers(), strict=True))
            old = _old_merged(whole)
            streamed: dict[str, torch.Tensor] = {}
            bucket_bytes = 64 * 1024
            sizes = []
            for bucket in weight_buckets(sharded, bucket_bytes=bucket_bytes):
                sizes.append((sum(t.numel() * t.element_size() for _, t in bucket), len(bucket)))
                streamed.update(bucket)
            results[case] = {
                "shards_equal": same,
                "buffers_equal": buffers,
                "names": (list(old), list(streamed)),
                "values_equal": all(
                    torch.equal(old[k], streamed[k]) and old[k].dtype == streamed[k].dtype for k in old
                ),  # noqa: E501
                "buckets": sizes,
                "largest": max(t.numel() * t.element_size() for t in old.values()),
            }
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes of its own
def test_a_sharded_start_gives_the_whole_loads_shards_and_the_stream_pushes_what_the_whole_state_dict_did(tmp_path):
    # 23 vocabulary rows: 12 on one process, 11 on the other (the gather pads the short shard)
    spec = dict(hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, vocab_size=23)
    model_dir = build_tiny_model(tmp_path / "tiny", **spec)
    shutil.copytree(model_dir, tmp_path / "tiny_bin")
    torch.save(load_file(model_dir / "model.safetensors"), tmp_path / "tiny_bin" / "pytorch_model.bin")
    (tmp_path / "tiny_bin" / "model.safetensors").unlink()
    out = tmp_path / "results.json"
    port = free_port("127.0.0.1")
    mp.start_processes(_ranks, args=(port, str(model_dir), str(out)), nprocs=2, start_method="spawn")
    results = json.loads(out.read_text())
    for case, found in results.items():
        assert all(found["shards_equal"].values()), (case, [n for n, ok in found["shards_equal"].items() if not ok])
        assert found["buffers_equal"], case
        old, streamed = found["names"]
        assert old == streamed and found["values_equal"], case
        for size, count in found["buckets"]:
            assert size <= 64 * 1024 or count == 1, (case, size, count)  # a larger tensor goes alone
        assert len(found["buckets"]) > 2
    assert any("lora" in name for name in results["lora_bf16"]["shards_equal"])


def test_a_model_built_with_its_parameters_on_meta_keeps_its_buffers_and_reads_nothing(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    config = AutoConfig.from_pretrained(model_dir)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert all(p.is_meta for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), loaded.buffers(), strict=True))  # rotary frequencies
    assert next(iter(model.parameters())).is_meta and not any(p.is_meta for p in torch.nn.Linear(2, 2).parameters())


def test_a_checkpoint_whose_names_are_not_the_models_is_loaded_whole_with_the_reason(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    model = load_policy(model_dir, on_meta=True)
    assert plan_sharded_start(model, model_dir).reason is None
    state = load_file(model_dir / "model.safetensors")
    save_file({f"transformer.{k}": v for k, v in state.items()}, model_dir / "model.safetensors")  # an older layout
    reason = plan_sharded_start(model, model_dir).reason
    assert "do not hold model.embed_tokens.weight" in reason and "more" in reason
    (model_dir / "model.safetensors").unlink()
    assert plan_sharded_start(model, model_dir).reason == f"{model_dir} has no safetensors weights"
    assert checkpoint_files(model_dir) == {}


def test_buckets_hold_at_most_their_bytes_in_order_and_a_larger_tensor_alone(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    plan = push_plan(load_policy(model_dir))
    largest = max(item.nbytes for item in plan)
    buckets = buckets_of(plan, largest // 2)
    assert [item for bucket in buckets for item in bucket] == plan
    for bucket in buckets:
        assert sum(item.nbytes for item in bucket) <= largest // 2 or len(bucket) == 1
    assert len(buckets_of(plan, 10**12)) == 1 and len(buckets_of(plan, 1)) == len(plan)


def test_an_engine_checks_a_streams_names_before_it_copies_a_tensor_and_takes_the_rest_as_it_comes(tmp_path):
    """``HFEngine`` reads a stream's plan first: a name its model lacks stops the push before any weight changes;
    a good stream is copied a tensor at a time, into exactly the pushed values."""
    from amir_lightning.engines import HFEngine
    from amir_lightning.engines.digest import PushStream
    from amir_lightning.models.sharded import WeightStream

    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    engine = HFEngine(progress=False)
    engine.start(model_dir, seed=0)
    policy = load_policy(model_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stream = WeightStream(policy, bucket_bytes=4096)
    stream.plan[-1] = stream.plan[-1]._replace(name="lm_head.weights")  # one name the engine lacks, planned last
    with pytest.raises(KeyError, match="lm_head.weights"):
        engine.load_weights(PushStream(stream, None))
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())  # nothing copied
    engine.load_weights(PushStream(WeightStream(policy, bucket_bytes=4096), None))
    own = engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in policy.state_dict().items())
    engine.close()


def _one_engine_wrong(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from helpers.engines import HFDropsHalf
    from torch.distributed.device_mesh import init_device_mesh

    from amir_lightning.engines import HFEngine
    from amir_lightning.helpers.distributed import all_reduce
    from amir_lightning.loop.sync import StaleEngineError, SyncCheck

    try:
        policy = Policy(HFModel(model_dir))
        policy.build(torch.float32, mesh=init_device_mesh("cpu", (2,)))
        engine = (HFDropsHalf if rank == 1 else HFEngine)(progress=False)  # rank 1's engine misses half of a push
        engine.start(Path(model_dir), seed=0)
        check = SyncCheck()
        check.set_probe(policy.tokenizer, policy.tokenizer("3+4=")["input_ids"], "7")

        def reduce_max(values: list[float]) -> list[float]:
            return all_reduce(torch.tensor(values, dtype=torch.float64), "max").tolist()

        check.push_and_verify(policy, engine, reduce_max)  # the engines' own weights: nothing to miss yet
        reshard(policy.model)  # the probe's forward left the root gathered
        with torch.no_grad():  # an optimiser step, on each process's shards
            for param in policy.model.parameters():
                param.to_local().add_(0.01)
        try:
            check.push_and_verify(policy, engine, reduce_max)
            Path(f"{out}.{rank}").write_text("not stopped")
        except StaleEngineError as err:
            Path(f"{out}.{rank}").write_text(str(err))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes of their own
def test_one_process_whose_engine_is_wrong_stops_every_process_under_fsdp2_and_none_waits(tmp_path):
    """Under FSDP2 the probe's forward is a collective: a process whose engine is wrong must not skip it while the
    others run it. Both processes stop at the sync, each saying whose engine holds other weights."""
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    out = tmp_path / "stopped"
    context = mp.start_processes(
        _one_engine_wrong, args=(free_port("127.0.0.1"), str(model_dir), str(out)), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the processes still wait on each other after 240 s (a collective one of them skipped)")
    assert "this process's engine holds other weights" in (tmp_path / "stopped.1").read_text()
    assert "the engine of another process holds other weights" in (tmp_path / "stopped.0").read_text()


def _reference_ranks(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from amir_lightning.models.loading import is_sharded, load_reference

    try:
        policy = Policy(HFModel(model_dir))
        policy.build(torch.float32, mesh=init_device_mesh("cpu", (2,)), with_reference=True)
        copy = policy.reference_copy
        whole = load_reference(Path(model_dir), torch.float32)
        expected = {name: p.detach().clone() for name, p in whole.named_parameters()}
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        with torch.no_grad():
            want = whole(ids).logits
            with policy.reference() as reference:
                got = reference(ids).logits
        shard_fsdp2(whole, "cpu")  # the shards a whole load gives
        results = {
            "sharded": is_sharded(copy) and not any(p.requires_grad for p in copy.parameters()),
            "shards_equal": all(
                torch.equal(p.to_local(), q.to_local())
                for (_, p), (_, q) in zip(whole.named_parameters(), copy.named_parameters(), strict=True)
            ),
            "local_fraction": sum(p.to_local().numel() for p in copy.parameters())
            / sum(t.numel() for t in expected.values()),
            "logits_equal": torch.equal(want, got),
            "resharded": all(type(p).__name__ == "DTensor" for p in copy.parameters()),
        }
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes of its own
def test_the_reference_copy_starts_sharded_and_scores_as_the_whole_copy(tmp_path):
    """With a KL term and no LoRA the frozen copy of the initial policy is loaded as the policy is under FSDP2: each
    process reads its own rows (about half of the weights each), the shards are those of a whole load, and its logits
    equal the whole copy's, bit for bit; after a forward it holds its shard alone again."""
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2)
    out = tmp_path / "reference"
    port = free_port("127.0.0.1")
    mp.start_processes(_reference_ranks, args=(port, str(model_dir), str(out)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        found = json.loads(Path(f"{out}.{rank}").read_text())
        assert found["sharded"] and found["shards_equal"] and found["logits_equal"] and found["resharded"], found
        assert 0.4 < found["local_fraction"] < 0.6, found
