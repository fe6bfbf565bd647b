"""Shared set-up of the benchmarks: the bundled SmolLM2, arithmetic prompts, steady malloc, interleaved timing."""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def steady_malloc() -> None:
    """Keep freed multi-megabyte blocks in the process (glibc otherwise unmaps them and faults them back in)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def machine() -> str:
    """One line describing where the numbers come from."""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )


def interleaved(functions: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, alternating A B B A ...; returns seconds per call for each."""
    names = list(functions)
    for _ in range(warmup):
        for name in names:
            functions[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            functions[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    """The median."""
    return statistics.median(values)


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_step_arguments(parser) -> None:
    """The batch and model options shared by the training-step benchmarks."""
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="a local model directory instead of the bundled SmolLM2")
