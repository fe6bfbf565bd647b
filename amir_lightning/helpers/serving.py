"""Server processes this run starts (a vLLM server for rollouts or for a judge), and JSON over HTTP to a server.

The process ends with the run however the run ends: ``atexit``, and on Linux ``PR_SET_PDEATHSIG`` (the kernel sends
it SIGTERM when the process that started it dies, SIGKILL included). The kernel ties that signal to the *thread*
that started the server, so it is asked for only from the main thread (a server started from a worker thread would
stop when that thread ends). Requests go to the server directly, never
through a cluster's HTTP proxy.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

#: Requests to a server go to it directly: a cluster's HTTP proxy settings would send them to the proxy.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
#: The training processes' group, which a started server must not join.
TRAINER_GROUP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def reachable_url(host: str, port: int) -> str:
    """The address other processes reach a server listening on ``host``:``port`` at."""
    return f"http://{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}"


class ServerProcess:
    """A server started here: its process, its address and its output file.

    Args:
        command: The command line (``python -m vllm.entrypoints.openai.api_server ...``).
        env: Its environment.
        url: The address it will answer at.
        log_path: Where its output goes.
        what: How errors name it (``the vLLM server``, ``the judge's vLLM server``).
    """

    def __init__(self, command: list[str], env: dict[str, str], url: str, log_path: Path, what: str) -> None:
        self.url, self.log_path, self.what = url, Path(log_path), what
        on_main = threading.current_thread() is threading.main_thread()
        with self.log_path.open("w") as out:
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_end_with_parent if on_main else None
            )
        atexit.register(self.close)
        log.info("started %s at %s (its output: %s)", what, url, log_path)

    def wait_until_ready(self, timeout: float, key: str) -> None:
        """Return once ``/health`` answers; an error with the end of its output when it stops or ``timeout`` passes.

        ``key`` names the setting that holds ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.what} stopped while starting (exit {self.process.returncode}):\n{self.log_tail()}"
                )
            if healthy(self.url):
                return
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"{self.what} at {self.url} did not answer within {key} ({timeout:g} s):\n"
                                   + self.log_tail())  # fmt: skip
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its output."""
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 30 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_for(url: str, timeout: float, key: str, what: str) -> None:
    """Return once the server at ``url`` (started elsewhere) answers; ``key`` names the setting of ``timeout``."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} at {url} did not answer within {key} ({timeout:g} s)")
        time.sleep(0.5)


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``/health``."""
    try:
        with DIRECT.open(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def post_json(
    url: str,
    route: str,
    body: dict | None,
    timeout: float,
    what: str,
    server: ServerProcess | None,
    headers: dict[str, str] | None = None,
) -> dict:
    """POST ``body`` as JSON to ``url + route`` and return the answer's JSON.

    Errors name ``what`` and the route, with the end of the output of ``server`` (when this run started it) where it
    did not answer.
    """
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(
        f"{url}{route}", data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with DIRECT.open(request, timeout=timeout) as response:
            text = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{what} at {url} refused {route} ({err.code}): {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        tail = "\n" + server.log_tail() if server is not None else ""
        raise RuntimeError(f"{what} at {url} did not answer {route}: {err}{tail}") from None
    return json.loads(text) if text else {}


def _end_with_parent() -> None:
    """Run in the server's process before it starts: it gets SIGTERM when the process that started it dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
