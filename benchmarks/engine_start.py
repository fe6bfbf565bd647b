"""What an in-process vLLM engine (``VLLMEngine``) costs to start and close in a process that has imported what
``amir fit`` imports, and how much of it is the garbage collector: vLLM runs full collections while it loads a model
and while it shuts down, and each scans every object the process holds. ``VLLMEngine.start`` freezes what the process
held before (``gc.freeze``), so the collections while it loads scan only what vLLM makes; "no freeze" is the start
as it was before, with ``gc.freeze`` made a no-op. Each row is a fresh process (the same imports, the tiny model).
Prints a table.

    .venv/bin/python benchmarks/engine_start.py        # about 40 s on 2 cores; run it on an idle machine
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import gc, json, sys, time

from amir_lightning.cli import main  # noqa: F401 (as the `amir` console script begins)
import lightning.pytorch, transformers, vllm.v1.engine.llm_engine  # noqa: F401, E401 (what a run has imported)
from vllm import LLM  # noqa: F401

from amir_lightning.models import build_tiny_model
from amir_lightning.engines import VLLMEngine

if sys.argv[2] == "no freeze":
    gc.freeze = lambda: None
model = build_tiny_model(sys.argv[1], seed=0)
full, spent, started = [0], [0.0], [0.0]

def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - started[0]
        full[0] += info["generation"] == 2

held = len(gc.get_objects())
gc.callbacks.append(timed)
engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)
tick, cpu = time.perf_counter(), time.process_time()
engine.start(model, seed=0)
start = [time.perf_counter() - tick, time.process_time() - cpu, spent[0], full[0]]
full[0], spent[0] = 0, 0.0
tick = time.perf_counter()
engine.close()
print(json.dumps({"held": held, "start": start, "close": [time.perf_counter() - tick, spent[0], full[0]]}))
"""


def main() -> None:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["TORCHDYNAMO_DISABLE"] = "1"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("freeze (now)", "no freeze (before)"):
            model = Path(folder) / mode.split()[0].replace(" ", "_")
            out = subprocess.run([sys.executable, "-c", SCRIPT, str(model), mode.split(" (")[0]], env=env,
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            rows.append((mode, json.loads(out.strip().splitlines()[-1])))
    print(f"objects the process held before the start: {rows[0][1]['held']:,}")
    print("| engine | start s | start CPU s | start in gc s (full collections) | close s | close in gc s (full) |")
    print("|---|---|---|---|---|---|")
    for mode, r in rows:
        (wall, cpu, gc_s, full), (close, close_gc, close_full) = r["start"], r["close"]
        cells = [f"{wall:.2f}", f"{cpu:.2f}", f"{gc_s:.2f} ({full})", f"{close:.2f}", f"{close_gc:.2f} ({close_full})"]
        print(f"| {mode} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
