"""Servers that hang or die, and runs that end in each way, for ``tests/e2e/test_server_processes.py``.

``StopsServerAt`` is a ``VLLMServerEngine`` that stops its own server (SIGSTOP: a hung server) before the
``at_call``-th generation sends its requests; ``KillsMidGeneration`` kills its own training process while the
server runs the ``at_call``-th generation's requests (``tests/e2e/test_stops.py``). Run as a script
(``python server_runs.py MODE MODEL_DIR``), this file starts a server engine, says its process (``SERVER PID N``)
and ends as ``MODE`` says: ``error`` (an exception), ``sigint`` (it generates until the signal comes, which the test
sends once it has stopped the server: a request is blocked), ``server_sigkill`` (it generates until its server is
killed).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import urllib.request

from amir_lightning.engines import SamplingConfig, VLLMServerEngine

log = logging.getLogger(__name__)
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}


class _AtCall(VLLMServerEngine):
    """A server engine that does ``fault()`` as generation call ``at_call`` (1-based) starts."""

    def __init__(self, at_call: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls = at_call, 0

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.calls += 1
        if self.calls == self.at_call:
            self.fault()
        return super().generate(prompts, n, sampling, seed)


class StopsServerAt(_AtCall):
    """Sends SIGSTOP to its server before generation call ``at_call`` (1-based) asks it anything."""

    def fault(self) -> None:  # noqa: D102
        os.kill(self.process.pid, signal.SIGSTOP)
        log.warning("test: SIGSTOP sent to the vLLM server (process %d)", self.process.pid)


class KillsMidGeneration(_AtCall):
    """SIGKILLs its own (the training) process in generation call ``at_call`` (1-based), once the server runs its
    requests: the process dies with a rollout half sampled."""

    def fault(self) -> None:  # noqa: D102
        threading.Thread(target=self._kill_when_running, daemon=True).start()

    def _kill_when_running(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and running_requests(self.url) == 0:
            time.sleep(0.01)
        log.warning("test: SIGKILL with %d requests running", running_requests(self.url))
        os.kill(os.getpid(), signal.SIGKILL)


def running_requests(url: str) -> float:
    """vLLM's ``vllm:num_requests_running`` (its Prometheus metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def main(mode: str, model_dir: str) -> None:
    from amir_lightning.helpers import stops
    from amir_lightning.helpers.http import ServerError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stops.catch_stop_signals()  # as `amir` does: SIGTERM ends a blocked request and runs the exit handlers
    engine = VLLMServerEngine(**SERVER)
    engine.start(model_dir, seed=0)
    print(f"SERVER PID {engine.process.pid}", flush=True)
    sampling = SamplingConfig(max_new_tokens=8)
    engine.generate([[1, 2, 3]], 2, sampling)
    if mode == "error":
        time.sleep(3.0)  # the test looks at the server's processes meanwhile
        raise RuntimeError("the run failed")
    try:
        while True:
            engine.generate([[1, 2, 3]] * 4, 2, sampling)
    except ServerError as err:
        print(f"ServerError: {err}", flush=True)
        sys.exit(3)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
