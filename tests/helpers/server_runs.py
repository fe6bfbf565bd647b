"""Servers that hang or die, and runs that end in each way, for ``tests/e2e/test_server_processes.py``.

``StopsServerAt`` is a ``VLLMServerEngine`` that stops its own server (SIGSTOP: a hung server) before the
``at_call``-th generation sends its requests. Run as a script (``python server_runs.py MODE MODEL_DIR``), this file
starts a server engine, says its process (``SERVER PID N``) and ends as ``MODE`` says: ``normal`` (it returns),
``error`` (an exception), ``sigterm`` and ``sigint`` (it generates until the signal comes, which the test sends
once it has stopped the server: a request is blocked), ``sigkill`` (it waits to be killed), ``server_sigkill`` (it
generates until its server is killed).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from amir_lightning.rollout import SamplingConfig, VLLMServerEngine

log = logging.getLogger(__name__)
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}


class StopsServerAt(VLLMServerEngine):
    """Sends SIGSTOP to its server before generation call ``at_call`` (1-based) asks it anything."""

    def __init__(self, at_call: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.at_call, self.calls = at_call, 0

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.calls += 1
        if self.calls == self.at_call:
            os.kill(self.process.pid, signal.SIGSTOP)
            log.warning("test: SIGSTOP sent to the vLLM server (process %d)", self.process.pid)
        return super().generate(prompts, n, sampling, seed)


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
    time.sleep(3.0 if mode in ("normal", "error") else 0.0)  # the test looks at the server's processes meanwhile
    if mode == "error":
        raise RuntimeError("the run failed")
    if mode == "sigkill":
        time.sleep(600)
    try:
        while mode in ("sigterm", "sigint", "server_sigkill"):
            engine.generate([[1, 2, 3]] * 4, 2, sampling)
    except ServerError as err:
        print(f"ServerError: {err}", flush=True)
        sys.exit(3)
    except SystemExit:  # SIGTERMException
        print("stopped by SIGTERM", flush=True)
        sys.exit(143)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
