"""Grade untrusted model output in worker processes with a hard wall-clock timeout and a memory cap.

Model output reaches a sympy parser, and ``9^9^9^9`` or a LaTeX bomb can hang it or eat all memory. math-verify's
own timeouts use ``signal.alarm``, which only works in the main thread; here every answer is graded in a spawned
worker process, and a worker that overruns ``timeout_s`` is killed (the answer scores ``timeout_score``) and
replaced. Workers start lazily, once, and are reused.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
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


def _worker_main(conn: Connection, memory_mb: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the workers
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:  # import the grader's heavy dependencies before the first deadline starts
        import math_verify  # noqa: F401
    except ImportError:
        pass
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
    def __init__(self, ctx, memory_mb: int | None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, memory_mb), daemon=True)
        with _sigint_ignored():  # inherited through exec: a Ctrl-C while the worker starts is not its to report
            self.process.start()
        child.close()
        self.job: tuple[int, float] | None = None  # (index, deadline)
        try:
            ready = self.conn.poll(120) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(
                "a grading worker process failed to start. Workers are spawned: a script that grades must keep its "
                "top-level code under `if __name__ == '__main__':`"
            )

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
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
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    def _ensure_workers(self) -> None:
        if self.num_workers is None:  # decided in the training process, once it is launched
            self.num_workers = default_workers()
            log.info("grading with %d worker process%s", self.num_workers, "es" if self.num_workers > 1 else "")
        self._workers = [w for w in self._workers if w.process.is_alive()]
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.memory_mb))

    def map(self, fn: Callable[..., float], arguments: Sequence[tuple], progress: str | None = None) -> list[float]:
        """``[fn(*args) for args in arguments]``, each in a worker under the deadline (``fn`` must be importable).

        ``progress``: the label of a progress bar over the answers (none when ``None``).
        """
        self._ensure_workers()
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
                    self._replace(worker)
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
                    self._replace(worker)
                    bar.update()
        bar.close()
        return results

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self._workers.append(_Worker(self._ctx, self.memory_mb))

    def close(self) -> None:
        """Stop the workers."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
