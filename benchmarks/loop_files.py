"""Which library files and functions one rollout runs through: the size of "the loop" a reader has to follow.

    python benchmarks/loop_files.py            # the engine in the training process (configs/tiny.yaml)
    python benchmarks/loop_files.py --server   # a vLLM server, the next rollout sampled ahead (max_staleness 1)

Runs ``configs/tiny.yaml`` (real vLLM, the math reward, AMIR-GRPO) for two rollouts in this process and records,
with ``sys.setprofile``, every Python function of ``amir_lightning/`` and ``callbacks/`` called from the end of the
first rollout to the end of the second: the weight sync, generation, rewards, advantages, the steps and the
monitors. Checkpoints are not written and validation is off. Work in the reward's grading processes is not traced
(it runs in other processes); ``rewards/sandbox.py`` shows up as the caller that hands it over.
Prints the files (library, then monitors) with how many of their functions ran (comprehensions and lambdas
count as part of the function around them), then the follow cost of the loop: the distinct file-to-file hops
(a call from a function of one library file into another's), and the back-and-forths, the calls whose caller
sits in a lower part of the package than the callee by the tier table of ``tests/test_imports.py`` (a layer
calling back up through a closure or a bound method it was handed), each listed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY, MONITORS = ROOT / "amir_lightning", ROOT / "callbacks"
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")  # parts of the function around them
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}  # as tests/test_server_engine.py
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's package, whatever is installed
from test_imports import TIERS  # noqa: E402 (the package's layers, lowest first)

TIER = {part: level for level, parts in enumerate(TIERS) for part in parts} | {"callbacks": len(TIERS)}


def tier_of(path: Path) -> int:
    """The layer of a library file (``callbacks/`` above the package: monitors call into it)."""
    if path.is_relative_to(MONITORS):
        return TIER["callbacks"]
    part = path.relative_to(LIBRARY).parts[0].removesuffix(".py")
    return TIER.get(part, len(TIERS) - 1)  # amir_lightning/__init__.py, __main__.py: the top


def ours(path: Path) -> bool:
    return path.is_relative_to(LIBRARY) or path.is_relative_to(MONITORS)


def function_of(frame) -> tuple[Path, str]:
    """The file and the function a frame runs in, a comprehension or lambda counted as the function around it."""
    while frame is not None and frame.f_code.co_qualname.endswith(INLINE) and frame.f_back is not None:
        if Path(frame.f_back.f_code.co_filename) != Path(frame.f_code.co_filename):
            break  # a lambda handed to another file: it stands for itself
        frame = frame.f_back
    return Path(frame.f_code.co_filename), frame.f_code.co_qualname


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", action="store_true", help="a vLLM server, the next rollout sampled ahead")
    server = parser.parse_args().server
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lightning.pytorch.callbacks import Callback

    from amir_lightning.cli import main as amir

    seen: dict[Path, set[str]] = defaultdict(set)
    hops: set[tuple[Path, Path]] = set()
    upward: dict[tuple[Path, str, Path, str], int] = defaultdict(int)  # (caller, callee) -> calls

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        name = frame.f_code.co_qualname
        if not ours(path):
            return
        if not name.endswith(INLINE):
            seen[path].add(name)
        if frame.f_back is None or not ours(Path(frame.f_back.f_code.co_filename)):
            return  # called by Lightning, torch or the standard library
        (caller, caller_name), (callee, callee_name) = function_of(frame.f_back), function_of(frame)
        if caller != callee:
            hops.add((caller, callee))
        if tier_of(caller) < tier_of(callee):
            upward[caller, caller_name, callee, callee_name] += 1

    class Trace(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                sys.setprofile(profile)
                threading.setprofile(profile)
            else:
                sys.setprofile(None)
                threading.setprofile(None)

    Trace.__module__ = "__main__"
    sys.modules["__main__"].Trace = Trace  # for class_path: __main__.Trace
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        os.environ["AMIR_CACHE"] = str(Path(folder) / "cache")
        args = ["fit", "--config", str(ROOT / "configs/tiny.yaml"), "--trainer.max_epochs", "2"]
        args += ["--checkpoint.save_on_train_epoch_end", "false", "--trainer.check_val_every_n_epoch", "100"]
        args += ["--trainer.callbacks+", "__main__.Trace", "--model.export.dir", str(Path(folder) / "policy")]
        if server:
            engine = {"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": SERVER}
            args += ["--data.engine", json.dumps(engine), "--data.rollout.max_staleness", "1"]
        amir(args)
    for title, root in (("library", LIBRARY), ("monitors", MONITORS)):
        files = sorted((p for p in seen if p.is_relative_to(root)), key=lambda p: str(p))
        print(f"\n{title}: {len(files)} files, {sum(len(seen[p]) for p in files)} functions")
        for path in files:
            print(f"  {path.relative_to(ROOT)!s:48} {len(seen[path]):3d}  {', '.join(sorted(seen[path]))[:150]}")
    print(f"\nfollow cost ({'server, a rollout ahead' if server else 'colocated engine'}):")
    print(f"  file-to-file hops: {len(hops)} distinct")
    print(f"  back-and-forths (a lower layer calling up): {len(upward)} distinct, {sum(upward.values())} calls")
    for (caller, caller_name, callee, callee_name), calls in sorted(upward.items(), key=lambda item: str(item[0])):
        where = f"{caller.relative_to(ROOT)}:{caller_name}"
        print(f"    {where:70} -> {callee.relative_to(ROOT)}:{callee_name} ({calls}x)")


if __name__ == "__main__":
    main()
