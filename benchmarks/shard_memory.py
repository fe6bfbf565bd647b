"""Memory per training process at the start and during a push, FSDP2 on 2 CPU processes (gloo): whole, then sharded.

    python benchmarks/shard_memory.py [--sizes 0.1B 0.5B 1.5B] [--ways whole sharded] [--bucket-mib 256]

Random Qwen2-shaped models, saved in bf16 as hub checkpoints are (``--checkpoint-dtype``), written once under
``--models``, trained in float32 as ``tiny.yaml`` and full fine-tuning do. Each of 2 processes starts the
policy as the run does under ``ModelParallelStrategy`` and pushes it once as the server engine does (every process
takes part; the first writes the safetensors file the server loads, in ``--out``):

- ``whole``, as main did before ``models/sharded.py``: each process loads the whole model (``from_pretrained``), then
  ``fully_shard``; a push gathers the whole state dict on every process (``get_model_state_dict(full_state_dict)``),
  and the first copies it to host memory and writes it with ``save_file``.
- ``sharded``: ``Policy.build`` (the sharded start: meta device, each process reads its rows); a push is the
  ``WeightStream`` of buckets of ``--bucket-mib``, which the first writes as it comes (``write_weights``).

Memory is ``RssAnon`` of ``/proc/self/status`` (what a process holds; the safetensors files it maps are page cache,
which the kernel takes back; the most of them mapped during set-up is shown beside it, as "files mapped"): after the
imports (torch, transformers, peft), its peak during set-up, after set-up, and its peak during the push
less what it held before ("push adds"), read every millisecond. Each column is the larger of the two processes'.
Blocks of 1 MiB and more go back to the system when freed (``freed_to_the_system``), in both ways alike.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import machine

GIB = 2**30
#: Qwen2 shapes of about 0.1B, 0.5B (Qwen2.5-0.5B) and 1.5B (Qwen2.5-1.5B) parameters; a 32k vocabulary for 0.1B.
SHAPES = {
    "0.1B": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),  # fmt: skip
    "0.5B": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),  # fmt: skip
    "1.5B": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),  # fmt: skip
}


def status(field: str) -> float:
    """``field`` of ``/proc/self/status`` in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB
    raise KeyError(field)


class Peak:
    """The largest ``RssAnon`` (memory the process holds) and ``RssFile`` (pages of files it maps: the safetensors
    files, which the kernel can take back) while running, read every millisecond in a thread of its own."""

    def __init__(self) -> None:
        self.anon, self.file, self._running = status("RssAnon"), status("RssFile"), True
        self.file_before = self.file
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while self._running:
            self.anon, self.file = max(self.anon, status("RssAnon")), max(self.file, status("RssFile"))
            time.sleep(0.001)

    def stop(self) -> tuple[float, float]:
        """(peak ``RssAnon``, peak ``RssFile`` less what was mapped before)."""
        self._running = False
        self._thread.join()
        return max(self.anon, status("RssAnon")), self.file - self.file_before


def model_dir(root: Path, size: str, dtype: str) -> Path:
    """A random Qwen2 of ``size`` saved in ``dtype`` under ``root`` (written once; tied embeddings as the small
    Qwen2.5s)."""
    out = root / f"{size}-{dtype}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[size], tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = root / f".{out.name}.tmp"
    model.save_pretrained(tmp, max_shard_size="2GB")
    del model
    tmp.rename(out)
    return out


def whole(path: Path, mesh, out: Path, rank: int, _bucket: int) -> tuple[float, float, float, int]:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from amir_lightning.models.loading import load_policy, shard_fsdp2

    setup = Peak()
    model = load_policy(path)
    shard_fsdp2(model, "cpu")
    after, setup_peak = status("RssAnon"), setup.stop()
    push = Peak()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if rank == 0:
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state.items()}
        save_file(tensors, str(out / "push.safetensors"))
        del tensors
    sent = sum(t.numel() * t.element_size() for t in state.values())
    del state
    return after, setup_peak, push.stop()[0], sent


def sharded(path: Path, mesh, out: Path, rank: int, bucket: int) -> tuple[float, float, float, int]:
    from amir_lightning.engines.server_setup import write_weights
    from amir_lightning.models.policy import Policy
    from amir_lightning.models.sharded import WeightStream
    from amir_lightning.models.sources import HFModel

    policy = Policy(HFModel(str(path)))
    policy.scoring.fused_head = False  # the head check's forward is not what this measures
    setup = Peak()
    model = policy.build(torch.float32, mesh=mesh)
    after, setup_peak = status("RssAnon"), setup.stop()
    push = Peak()
    stream = WeightStream(model, bucket_bytes=bucket)
    sent = sum(item.nbytes for item in stream.plan)
    if rank == 0:
        write_weights(out / "push.safetensors", [tuple(p[:3]) for p in stream.plan], stream)
    else:
        for _ in stream:
            pass
    return after, setup_peak, push.stop()[0], sent


def freed_to_the_system() -> None:
    """glibc maps every block of 1 MiB or more on its own and unmaps it when freed (its threshold otherwise grows
    with the blocks freed, and freed tensors then stay in the heap): resident memory is then what the code holds."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: no longer moved by frees)
    libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD


def process(rank: int, port: int, way: str, path: str, out: str, bucket: int, result: str) -> None:
    freed_to_the_system()
    torch.set_num_threads(1)
    import peft  # noqa: F401  what every process imports before it loads a model
    import transformers  # noqa: F401

    import amir_lightning.models.policy  # noqa: F401

    imports = status("RssAnon")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        mesh = init_device_mesh("cpu", (2,))
        start = time.perf_counter()
        run = whole if way == "whole" else sharded
        after, setup_peak, push_peak, sent = run(Path(path), mesh, Path(out), rank, bucket)
        row = dict(imports=imports, after=after, setup_peak=setup_peak[0], mapped_peak=setup_peak[1],
                   push_adds=push_peak - after, sent=sent,
                   seconds=time.perf_counter() - start)  # fmt: skip
        Path(f"{result}.{rank}").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def parameters(path: Path) -> int:
    """The weights a checkpoint holds (a tied head once)."""
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ways", nargs="+", default=["whole", "sharded"], choices=["whole", "sharded"])
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "amir-shard-memory-models")
    args = parser.parse_args()
    args.models.mkdir(parents=True, exist_ok=True)
    print(machine())
    print(f"FSDP2 on 2 CPU processes (gloo), float32 weights from a {args.checkpoint_dtype} checkpoint, buckets of "
          f"{args.bucket_mib} MiB; GiB per process (the larger of the two)")  # fmt: skip
    print("| model | params | float32 GiB | a push sends | way | imports | set-up peak | files mapped | after set-up | "
          "push adds | largest tensor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        path = model_dir(args.models, size, args.checkpoint_dtype)
        config = json.loads((path / "config.json").read_text())
        embed = config["vocab_size"] * config["hidden_size"] * 4 / GIB
        for way in args.ways:
            with tempfile.TemporaryDirectory() as out:
                result = str(Path(out) / "row")
                mp.start_processes(process, args=(free_port(), way, str(path), out, args.bucket_mib * 2**20, result),
                                   nprocs=2, start_method="spawn")  # fmt: skip
                rows = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in (0, 1)]
            worst = {key: max(r[key] for r in rows) for key in rows[0]}
            params = parameters(path)
            cells = [size, f"{params / 1e9:.2f}B", f"{params * 4 / GIB:.2f}", f"{worst['sent'] / GIB:.2f}", way]
            cells += [f"{worst[key]:.2f}" for key in ("imports", "setup_peak", "mapped_peak", "after", "push_adds")]
            print("| " + " | ".join([*cells, f"{embed:.2f}"]) + " |", flush=True)


if __name__ == "__main__":
    main()
