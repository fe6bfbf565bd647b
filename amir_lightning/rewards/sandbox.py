"""Grade untrusted model output in worker processes with a hard wall-clock timeout and a memory cap.

Model output reaches a sympy parser, and ``9^9^9^9`` or a LaTeX bomb can hang it or eat all memory. math-verify's
own timeouts use ``signal.alarm``, which only works in the main thread; here every answer is graded in a worker
process, and a worker that overruns ``timeout_s`` is killed (the answer scores ``timeout_score``) and replaced.
Workers start lazily, once, and are reused.

A worker is a fresh interpreter that imports this module, math-verify and the grading function's module, nothing
else. Not the training script: ``multiprocessing``'s spawn runs the main module again in each child, and the ``amir``
console script's main module imports the whole CLI (4.5 s and 392 MB a worker on 2 cores). Not torch either:
``amir_lightning.rewards`` imports its classes on first use. A worker starts in about half a second.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def _address_space_bytes() -> int:
    """This process's mapped address space (Linux ``/proc/self/statm``); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


#: What a worker answers in place of an index when it cannot load the grading function it was sent.
UNLOADABLE = "unloadable"
#: What a worker runs: ``python -c WORKER <descriptor of its connection> <memory_mb or 0> <the function's module>``.
WORKER = "import sys; from amir_lightning.rewards.sandbox import serve; serve(*sys.argv[1:])"


def serve(fd: str, memory_mb: str, module: str) -> None:
    """A worker's life: grade what comes over the connection at ``fd`` until it closes (command-line strings)."""
    _worker_main(Connection(int(fd)), int(memory_mb) or None, module)


def _worker_main(conn: Connection, memory_mb: int | None, module: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the workers
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:  # import the grader's heavy dependencies before the first deadline starts
        import math_verify  # noqa: F401
    except ImportError:
        pass
    try:  # and the grading function's module, under no memory cap yet
        if module:
            importlib.import_module(module)
    except Exception as err:
        conn.send((UNLOADABLE, f"{type(err).__name__}: {err}"))
        return
    if memory_mb:
        # On top of what the worker maps once started: a CUDA build of torch alone maps gigabytes of libraries,
        # so a cap on the whole address space would fail the first import on a GPU machine.
        import resource

        limit = _address_space_bytes() + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer is gone (closed, or ended at once by a second Ctrl-C)
            return
        except Exception as err:  # the grading function's module is not found here: the trainer says so
            conn.send((UNLOADABLE, f"{type(err).__name__}: {err}"))
            continue
        if message is None:
            return
        index, fn, args = message
        try:
            score = float(fn(*args))
        except MemoryError:
            score = float("nan")
        except Exception:  # a grader error on hostile input is a wrong answer, not a crash
            score = float("nan")
        try:
            conn.send((index, score))
        except OSError:
            return


def default_workers(cap: int = 8) -> int:
    """Grading processes for one training process: its share of the cores it may run on, less one for itself.

    The share divides the cores this process may use (its CPU affinity: SLURM's ``--cpus-per-task`` binds it) by
    the training processes on the node (``LOCAL_WORLD_SIZE`` from torchrun, ``SLURM_NTASKS_PER_NODE``); at least 1,
    at most ``cap``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = 1
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "").split("(")[0].split(",")[0]  # SLURM writes "8" or "8(x2),4"
        if value.isdigit() and int(value) > 0:
            local = int(value)
            break
    return max(1, min(cap, cores // local - 1))


def _module(fn: Callable) -> str:
    """The module a worker imports ``fn`` from (``""``: none to import ahead, as for a ``functools.partial``)."""
    return getattr(fn, "__module__", None) or ""


def _unloadable(fn: Callable, error: str) -> str:
    name = f"{_module(fn)}.{getattr(fn, '__qualname__', fn)}"
    return f"a grading worker cannot load {name} ({error}): the function must be importable from where this process is"


@contextmanager
def _sigint_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _Worker:
    def __init__(self, memory_mb: int | None, fn: Callable) -> None:
        self.conn, child = mp.Pipe()
        # The grading function is sent by reference: the worker finds its module where this process does.
        path = [entry or os.getcwd() for entry in sys.path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        command = [sys.executable, "-c", WORKER, str(child.fileno()), str(memory_mb or 0), _module(fn)]
        with _sigint_ignored():  # inherited through exec: a Ctrl-C while the worker starts is not its to report
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, pass_fds=[child.fileno()])
        child.close()
        self.job: tuple[int, float] | None = None  # (index, deadline)
        try:
            ready = self.conn.recv() if self.conn.poll(120) else None
        except (EOFError, OSError):
            ready = None
        if isinstance(ready, tuple):  # (UNLOADABLE, the error)
            self.kill()
            raise RuntimeError(_unloadable(fn, ready[1]))
        if ready != "ready":
            self.kill()
            raise RuntimeError(f"a grading worker failed to start (its command: {subprocess.list2cmdline(command)})")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class SandboxedGrader:
    """A small pool of grading processes with a per-answer deadline.

    Args:
        timeout_s: Wall-clock limit per answer; an answer over it scores ``timeout_score``.
        num_workers: Worker processes; ``None``: this process's share of the cores, less one (``default_workers``).
        memory_mb: Address space a worker may map beyond what it holds once started (``RLIMIT_AS``); ``None`` for
            no cap.
        timeout_score: Score of an answer whose grading timed out or crashed.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int | None = None,
        memory_mb: int | None = 2048,
        timeout_score: float = 0.0,
    ) -> None:
        if timeout_s <= 0 or (num_workers is not None and num_workers < 1):
            raise ValueError(f"need timeout_s > 0 and num_workers >= 1, got {timeout_s} and {num_workers}")
        self.timeout_s, self.num_workers, self.memory_mb = timeout_s, num_workers, memory_mb
        self.timeout_score = timeout_score
        self.timeouts = 0
        self.latencies: list[float] = []
        self._workers: list[_Worker] = []

    def _ensure_workers(self, fn: Callable) -> None:
        if self.num_workers is None:  # decided in the training process, once it is launched
            self.num_workers = default_workers()
            log.info("grading with %d worker process%s", self.num_workers, "es" if self.num_workers > 1 else "")
        self._workers = [w for w in self._workers if w.alive()]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.memory_mb, fn))

    def map(self, fn: Callable[..., float], arguments: Sequence[tuple], progress: str | None = None) -> list[float]:
        """``[fn(*args) for args in arguments]``, each in a worker under the deadline (``fn`` must be importable).

        ``progress``: the label of a progress bar over the answers (none when ``None``).
        """
        if _module(fn) == "__main__":
            name = getattr(fn, "__qualname__", fn)
            raise ValueError(f"{name} is defined in the script being run: the grading workers import the function by "
                             "its module, so define it in a module of its own")  # fmt: skip
        self._ensure_workers(fn)
        bar = tqdm(total=len(arguments), desc=progress, unit="answer", leave=False, disable=progress is None)
        results = [self.timeout_score] * len(arguments)
        started = [0.0] * len(arguments)
        self.latencies = [0.0] * len(arguments)  # seconds from hand-over to answer (or kill), per argument
        pending = list(range(len(arguments)))[::-1]
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            for worker in self._workers:
                if worker.job is None and pending:
                    index = pending.pop()
                    # The deadline starts when the worker gets the job, so queueing never eats into it.
                    started[index] = time.monotonic()
                    worker.job = (index, started[index] + self.timeout_s)
                    worker.conn.send((index, fn, arguments[index]))
                    busy[worker.conn] = worker
            if not busy:
                break
            deadline = min(w.job[1] for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, deadline - time.monotonic())):
                worker = busy.pop(conn)
                try:
                    index, score = conn.recv()
                except (EOFError, OSError):  # the worker died (e.g. its memory cap): replace it
                    index, score = worker.job[0], float("nan")
                    self._replace(worker, fn)
                if index == UNLOADABLE:
                    raise RuntimeError(_unloadable(fn, score))
                results[index] = self.timeout_score if score != score else score
                self.latencies[index] = time.monotonic() - started[index]
                worker.job = None
                bar.update()
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if worker.job[1] <= now:
                    self.timeouts += 1
                    results[worker.job[0]] = self.timeout_score
                    self.latencies[worker.job[0]] = now - started[worker.job[0]]
                    busy.pop(conn)
                    self._replace(worker, fn)
                    bar.update()
        bar.close()
        return results

    def _replace(self, worker: _Worker, fn: Callable) -> None:
        worker.kill()
        self._workers.remove(worker)
        self._workers.append(_Worker(self.memory_mb, fn))

    def close(self) -> None:
        """Stop the workers."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            try:
                worker.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                worker.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
