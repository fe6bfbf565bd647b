"""Shared test set-up: offline, single-threaded, deterministic; GPU tests deselected without CUDA."""

import os

# Before any Hugging Face import: an accidental download must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def run_amir(args, tmp_path, timeout=600, console_script=False, env=None):
    """Run the ``amir`` CLI in a fresh process (each gets its own in-process vLLM engine), offline.

    ``console_script`` runs the installed ``amir`` script, as a user does, instead of ``python -m amir_lightning``
    (which puts the working directory on ``sys.path`` by itself); ``env`` replaces this process's environment.
    """
    import subprocess
    import sys
    from pathlib import Path

    env = dict(env or os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    if console_script:
        env.pop("PYTHONPATH", None)
    prefix = [str(Path(sys.executable).parent / "amir")] if console_script else [sys.executable, "-m", "amir_lightning"]
    cmd = [*prefix, *args]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def read_scalars(log_dir):
    """All scalars of the TensorBoard event files under ``log_dir``: {tag: [values in step order]}."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return scalars
