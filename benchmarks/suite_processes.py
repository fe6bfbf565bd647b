"""What a process of its own costs the test suite: a 2-rollout run of configs/tiny.yaml started fresh (``python -m
amir_lightning``) against the same run forked from a process that has imported ``amir`` (``tests/helpers/forks.py``),
and the start of a vLLM server (``tests/helpers/served.py`` shares one per test file). Prints a table.

    .venv/bin/python benchmarks/suite_processes.py        # about 1 minute on 2 cores; run it on an idle machine
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests"))
TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
os.environ.update(TEST_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", TORCHDYNAMO_DISABLE="1")

from helpers import forks  # noqa: E402


def tiny_run(run, folder: Path) -> float:
    """Seconds of one 2-rollout run of configs/tiny.yaml (no validation) by ``run`` (``subprocess.run`` or forks')."""
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "2"]
    args += ["--trainer.check_val_every_n_epoch", "50"]
    folder.mkdir(parents=True)
    env = dict(os.environ, AMIR_CACHE=str(folder.parent / "cache"))
    start = time.perf_counter()
    done = run([sys.executable, "-m", "amir_lightning", *args], cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return time.perf_counter() - start


def server_start(folder: Path) -> float:
    """Seconds from a server engine's start to its first answer (the tiny model, the tests' settings)."""
    from helpers.served import SETTINGS

    from amir_lightning.engines import VLLMServerEngine
    from amir_lightning.models import build_tiny_model

    model = build_tiny_model(folder / "model", seed=0)
    engine = VLLMServerEngine(**SETTINGS)
    start = time.perf_counter()
    engine.start(model, seed=0)
    seconds = time.perf_counter() - start
    engine.close()
    return seconds


def main() -> None:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_run(subprocess.run, tmp / "warm")  # the tiny model built and cached, files in the page cache
        start = time.perf_counter()
        forks.forks()
        zygote = time.perf_counter() - start
        fresh = tiny_run(subprocess.run, tmp / "fresh")
        forked = tiny_run(forks.run, tmp / "forked")
        weights = [load_file(tmp / name / "runs" / "tiny" / "version_0" / "policy" / "model.safetensors")
                   for name in ("fresh", "forked")]  # fmt: skip
        first, second = weights
        same = first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)
        server = server_start(tmp / "server")
    print("| what | s |")
    print("|---|---|")
    print(f"| the forking process's imports (once per test process) | {zygote:.1f} |")
    print(f"| 2-rollout tiny run, fresh `python -m amir_lightning` | {fresh:.1f} |")
    print(f"| the same run, forked | {forked:.1f} |")
    print(f"| a vLLM server's start (the tiny model) | {server:.1f} |")
    print(f"\nfresh and forked runs end with the same weights: {same}")


if __name__ == "__main__":
    main()
