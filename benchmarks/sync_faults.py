"""The exact weight-sync check against engines that take pushes wrong, a correct bf16 engine over a long run, and
what the check costs.

    python benchmarks/sync_faults.py [--syncs 12] [--long 1000] [--smollm2] [--server]

Engines are the real ``VLLMEngine`` and ``HFEngine`` (tests/helpers/engines.py breaks their ``load_weights``); the
"trainer" is a float32 copy of a tiny random Qwen2 moved by a random step (0.01 per weight) before every sync.

1. Faulty engines, each dtype: the sync at which ``SyncCheck`` stopped, against the first sync whose pushed weights
   the engine does not hold (ignoring pushes after the third: the fourth; a 55 % update: the second, the first push
   being the engine's initial weights; every other tensor dropped: the second for HFEngine, the first for vLLM, whose
   reload rebuilds a layer fed part of its tensors; a weight in the wrong place or sign, from a transposed ``q_proj``
   to k and v exchanged inside ``qkv_proj``: the first).
2. Correct bf16 engines over ``--long`` syncs at a 0.003 step: stops (none expected) and the probe gap at the first
   and last sync, which grows with the drift (what the statistical check of earlier versions stopped on).
3. ``--server``: the same 12 faults, each dtype, on ``VLLMServerEngine`` pushing over the gloo transfer (the faults
   of tests/helpers/engines.py's ``Server*`` engines, the layout ones included), to one of two servers of the dtype;
   and both servers as replicas of one engine, the second of which stops taking pushes after the second (the
   third sync is the first it misses).
4. ``--smollm2``: seconds per sync of the bundled SmolLM2-135M into a float32 vLLM engine, without the weight check
   (``data.sync.verify_weights``), with it (the CPU kernels read on 64 columns a sync), and reading every column;
   and into a float32 HFEngine, which reads every tensor back whole.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from test_sync import FAULTS, Trainer, make_engine, syncs_until_stopped  # noqa: E402
from test_transfer import SERVER_FAULTS  # noqa: E402

from amir_lightning.engines import HFEngine, VLLMEngine  # noqa: E402
from amir_lightning.loop.sync import SyncCheck, SyncSettings  # noqa: E402
from amir_lightning.models import build_tiny_model  # noqa: E402


def faults(model_dir: Path, syncs: int) -> None:
    print("| engine | fault | dtype | first wrong sync | stopped at sync |")
    print("|---|---|---|---|---|")
    for engine_cls, kwargs, first_wrong, _ in FAULTS:
        for dtype in ("float32", "bfloat16"):
            engine = make_engine(engine_cls, dtype, **kwargs)
            engine.start(model_dir, seed=0)
            stopped = syncs_until_stopped(engine, Trainer(model_dir), syncs)
            engine.close()
            base = next(c.__name__ for c in engine_cls.__mro__ if c in (HFEngine, VLLMEngine))
            fault = engine_cls.__name__.removeprefix(base.removesuffix("Engine"))
            fault += f" {' '.join(map(str, kwargs.values()))}" if kwargs else ""
            print(f"| {base} | {fault} | {dtype} | {first_wrong} | {stopped or f'not in {syncs}'} |")


def server_faults(model_dir: Path, syncs: int) -> None:
    """The faults on a server reached over the gloo transfer, and a replica that stops taking pushes."""
    from helpers.engines import ServerReplicaIgnoresPushesAfter

    from amir_lightning.engines import VLLMServerEngine

    settings = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2}
    print("\n| engine (gloo transfer) | fault | dtype | first wrong sync | stopped at sync | the error names |")
    print("|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        servers = VLLMServerEngine(**settings, dtype=dtype, threads=1, replicas=2)
        servers.start(model_dir, seed=0)
        try:
            cases = [(cls, kwargs, first, [servers.urls[0]]) for cls, kwargs, first, _ in SERVER_FAULTS]
            cases.append((ServerReplicaIgnoresPushesAfter, {"good_pushes": 2}, 3, servers.urls))
            for engine_cls, kwargs, first_wrong, urls in cases:
                engine = engine_cls(url=urls, dtype=dtype, **settings, **kwargs)
                engine.start(model_dir, seed=0)
                errors: list[str] = []
                stopped = syncs_until_stopped(engine, Trainer(model_dir), syncs, errors=errors)
                trainer = Trainer(model_dir)  # whole weights again, for the next engine
                with trainer.export_weights() as named:
                    VLLMServerEngine.load_weights(servers, named)
                engine.close()
                fault = engine_cls.__name__.removeprefix("Server")
                fault += f" {' '.join(map(str, kwargs.values()))}" if kwargs else ""
                named = errors[0].partition("the first: ")[2].split(" (")[0].rstrip(".") if errors else ""
                where = f"{len(urls)} replica(s)"
                print(f"| VLLMServerEngine, {where} | {fault} | {dtype} | {first_wrong} | "
                      f"{stopped or f'not in {syncs}'} | `{named[:90]}` |", flush=True)  # fmt: skip
        finally:
            servers.close()


def long_run(model_dir: Path, syncs: int) -> None:
    print(f"\n| correct engine, bf16 | syncs | stopped | probe gap at sync 1 | probe gap at sync {syncs} | "
          "largest probe gap | seconds per sync |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for engine_cls in (VLLMEngine, HFEngine):
        trainer, engine = Trainer(model_dir), make_engine(engine_cls, "bfloat16")
        engine.start(model_dir, seed=0)
        check = SyncCheck()
        check.set_probe(trainer.tokenizer, trainer.tokenizer("3+4=")["input_ids"], "7")
        gaps, start = [], time.perf_counter()
        for sync in range(syncs):
            gaps.append(check.push_and_verify(trainer, engine).gap)
            torch.manual_seed(sync)
            with torch.no_grad():
                for p in trainer.policy.parameters():
                    p.add_(0.003 * torch.randn_like(p))
        seconds = (time.perf_counter() - start) / syncs
        engine.close()
        print(f"| {engine_cls.__name__} | {syncs} | no | {gaps[0]:.2g} | {gaps[-1]:.2g} | {max(gaps):.2g} | "
              f"{seconds:.3f} |")  # fmt: skip


def smollm2_cost(repeats: int = 3) -> None:
    from amir_lightning.models.bundled import materialize_smollm2

    model_dir = materialize_smollm2()
    trainer = Trainer(model_dir)
    engine = VLLMEngine(dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 * 1024**2, progress=False)
    engine.start(model_dir, seed=0)
    print(f"\n| SmolLM2-135M, float32, {torch.get_num_threads()} thread(s) | seconds per sync | CPU seconds per sync |")
    print("|---|---|---|")
    settings = {
        "push and probe (verify_weights: false)": SyncSettings(verify_weights=False),
        "push, probe and weight check (default: kernels read on 64 columns)": SyncSettings(),
        "push, probe and weight check, kernels read on every column (kernel_columns: null)": SyncSettings(
            kernel_columns=None
        ),
    }
    for label, setting in settings.items():
        print(f"| {label} | {' | '.join(f'{t:.2f}' for t in seconds_per_sync(trainer, engine, setting, repeats))} |")
    engine.close()
    engine = HFEngine(dtype="float32", progress=False)
    engine.start(model_dir, seed=0)
    for label, setting in {"HFEngine: push and probe": SyncSettings(verify_weights=False),
                           "HFEngine: push, probe and weight check": SyncSettings()}.items():  # fmt: skip
        print(f"| {label} | {' | '.join(f'{t:.2f}' for t in seconds_per_sync(trainer, engine, setting, repeats))} |")


def seconds_per_sync(trainer, engine, settings: SyncSettings, repeats: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread: the engine runs in it) per sync."""
    check = SyncCheck(settings)
    check.set_probe(trainer.tokenizer, trainer.tokenizer("What is 3 + 4?")["input_ids"], "7")
    check.push_and_verify(trainer, engine)  # the first sync also reads the engine's layout
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        check.push_and_verify(trainer, engine)
    return (time.perf_counter() - start) / repeats, (time.process_time() - cpu) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=12, help="syncs per faulty engine")
    parser.add_argument("--long", type=int, default=1000, help="syncs of the correct bf16 engines")
    parser.add_argument("--smollm2", action="store_true", help="also time a sync of the bundled SmolLM2")
    parser.add_argument("--server", action="store_true", help="the faults through a server's gloo transfer alone")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=2)
        if args.server:
            server_faults(model_dir, args.syncs)
            return
        faults(model_dir, args.syncs)
        long_run(model_dir, args.long)
    if args.smollm2:
        smollm2_cost()


if __name__ == "__main__":
    main()
