"""Seconds and bytes of a push to a vLLM server (CPU), by transfer: a file in a shared folder against the gloo stream.

    python benchmarks/push_transfer.py [--models smollm2 1.5B] [--pushes 3] [--transfers file gloo]

One training process pushes its policy to a ``VLLMServerEngine`` it started, as a sync does (the ``WeightStream`` of
256 MiB buckets, digested for the exact check, then read back): ``transfer: file`` writes a safetensors file in
``/dev/shm`` that the server's worker loads; ``transfer: gloo`` broadcasts each bucket to the worker over a gloo
group of their own (``engines/transfer.py``). Each push's wall time is from the stream's first tensor to the server's
answer to ``/finish_weight_update`` and ``/resume`` (the read-back is not in it); the median of ``--pushes`` after
one push not counted. ``--transfer-dir`` puts the file elsewhere than ``/dev/shm`` (which holds the whole model in
memory while a push lasts: at 1.5B, the trainer, the server and that file did not fit 24 GB here). Models: the
bundled SmolLM2-135M, and a random Qwen2 of 1.5B parameters (``benchmarks/shard_memory.py``'s, bf16 on disk, float32
in the trainer and the server).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import machine
from shard_memory import model_dir

GIB = 2**30


def policy_dir(name: str, models: Path) -> Path:
    if name == "smollm2":
        from amir_lightning.models.bundled import materialize_smollm2

        return materialize_smollm2()
    return model_dir(models, name, "bfloat16")


def measure(path: Path, transfer: str, pushes: int, transfer_dir: str | None) -> tuple[float, float, list[float]]:
    """(GiB per push, median seconds, every push's seconds)."""
    from amir_lightning.engines import VLLMServerEngine
    from amir_lightning.engines.digest import PushStream
    from amir_lightning.models.loading import load_policy
    from amir_lightning.models.sharded import WeightStream

    model = load_policy(path)
    engine = VLLMServerEngine(
        max_model_len=256, kv_cache_memory_bytes=64 * 2**20, transfer=transfer, threads=1, transfer_dir=transfer_dir
    )
    engine.start(path, seed=0)
    try:
        seconds = []
        for push in range(pushes + 1):
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # a new version each time
            stream = PushStream(WeightStream(model), None)
            start = time.perf_counter()
            engine.load_weights(stream, push + 1)
            seconds.append(time.perf_counter() - start)
        return stream.bytes / GIB, statistics.median(seconds[1:]), seconds[1:]
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "1.5B"], choices=["smollm2", "0.1B", "0.5B", "1.5B"])
    parser.add_argument("--transfers", nargs="+", default=["file", "gloo"], choices=["file", "gloo"])
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--transfer-dir", default=None, help="the file transfer's folder (default: /dev/shm)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "amir-shard-memory-models")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(machine())
    print("| model | transfer | GiB per push | seconds per push (median) | GiB/s | every push (s) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        path = policy_dir(name, args.cache)
        for transfer in args.transfers:
            gib, median, each = measure(path, transfer, args.pushes, args.transfer_dir)
            runs = ", ".join(f"{s:.2f}" for s in each)
            print(f"| {name} | {transfer} | {gib:.2f} | {median:.2f} | {gib / median:.2f} | {runs} |", flush=True)


if __name__ == "__main__":
    main()
