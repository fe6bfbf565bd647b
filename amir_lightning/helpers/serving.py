"""Server processes this run starts (a vLLM server for rollouts or for a judge), and waiting for a server to answer.

Nothing a server starts outlives the run. The server leads a session of its own (``start_new_session``), so its
children (vLLM's engine core, multiprocessing's resource tracker) are in its process group, and ``close`` ends the
whole group, whether the server ended first or not; ``atexit`` calls it. Where the run's process is killed outright
(SIGKILL: no ``atexit``), a small watcher process ends the group: it holds the read end of a pipe whose write end
only the run's process holds, and the kernel closes that end however the process dies. The server also gets
SIGTERM from the kernel when the thread that started it ends (``PR_SET_PDEATHSIG``; asked only from the main thread,
where that thread is the process).
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from amir_lightning.helpers import stops
from amir_lightning.helpers.http import Endpoint, ServerError, health

log = logging.getLogger(__name__)

#: The training processes' group, which a started server must not join.
TRAINER_GROUP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
STOP_S = 10.0  # a server's time to end after SIGTERM, before SIGKILL
PORTS_FROM = 20000  # where a server's port is drawn from (up to the ephemeral range); below: well-known services
REFUSED_S = 15.0  # how long a given url may refuse connections (a server launched beside the run binds its port)

#: The watcher: waits for the run's process to go (its pipe's end of file), then ends the server's process group.
WATCH = """
import os, signal, sys, time
group = int(sys.argv[2])
def members():
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(group) and fields[0] != "Z":
            found.append(name)
    return found
while os.read(0, 1):
    pass
if members():
    for sig in (signal.SIGTERM, signal.SIGCONT):
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    end = time.monotonic() + 10
    while members() and time.monotonic() < end:
        time.sleep(0.2)
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


def free_port(host: str) -> int:
    """A port nothing listens on at ``host`` now, below the kernel's ephemeral range where the system has room.

    A server binds the port seconds after it is chosen (vLLM binds once its imports are done). A port of the
    ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``) can be handed meanwhile to any socket that binds
    port 0 or connects out (a vLLM engine's internal ports, a process group's store, an HTTP client), and the server
    then stops with ``Address already in use``; no such socket draws a port below that range. The draw is from the
    system's entropy, so processes seeded alike do not draw alike.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64) if low - PORTS_FROM > 256 else ():
        port = draw.randrange(PORTS_FROM, low)
        if _bindable(host, port):
            return port
    with socket.socket() as probe:  # no room below the range (or all taken): one the kernel hands out
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and near what macOS (49152) and Windows (49152) use


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def reachable_url(host: str, port: int) -> str:
    """The address other processes reach a server listening on ``host``:``port`` at."""
    return f"http://{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}"


def group_members(group: int) -> list[int]:
    """The processes of process group ``group`` that have not ended (zombies left out), from ``/proc``."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        fields = _stat(name)
        if fields is not None and fields[2] == str(group) and fields[0] != "Z":
            found.append(int(name))
    return found


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ..."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class ServerProcess:
    """A server started here: its process (the leader of its own process group), its address and its output file.

    Args:
        command: The command line (``vllm serve ...``).
        env: Its environment.
        url: The address it will answer at.
        log_path: Where its output goes.
        what: How errors name it (``the vLLM server``, ``the judge's vLLM server``).
    """

    def __init__(self, command: list[str], env: dict[str, str], url: str, log_path: Path, what: str) -> None:
        self.url, self.log_path, self.what = url, Path(log_path), what
        on_main = threading.current_thread() is threading.main_thread()
        self._lock = threading.Lock()
        with self.log_path.open("w") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            preexec_fn=_end_with_parent if on_main else None)  # fmt: skip
        self.pid = self.process.pid  # and its process group's id
        read_end, self._lifeline = os.pipe()
        self._watcher = subprocess.Popen([sys.executable, "-c", WATCH, "amir-server-watch", str(self.pid)],
                                         stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)  # fmt: skip
        os.close(read_end)
        atexit.register(self.close)
        log.info("started %s at %s (process %d; its output: %s)", what, url, self.pid, log_path)

    def state(self) -> str:
        """``gone`` (it ended), ``stopped`` (SIGSTOP, a debugger) or ``running``."""
        if self.process.poll() is not None:
            return "gone"
        fields = _stat(self.pid)
        return "stopped" if fields is not None and fields[0] in ("T", "t") else "running"

    def gone_within(self, seconds: float) -> bool:
        """Whether it ends within ``seconds`` (a closed connection comes a moment before its exit status)."""
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def exit_text(self) -> str:
        """How it ended (``exit 1``, ``killed by SIGKILL``), or ``still running``."""
        code = self.process.poll()
        if code is None:
            return "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"

    def wait_until_ready(self, timeout: float, key: str) -> None:
        """Return once ``/health`` answers; a ``ServerError`` when it stops first or ``timeout`` (``key``) passes."""
        deadline = time.monotonic() + timeout
        while True:
            stops.raise_if_stopped()
            if self.process.poll() is not None:
                self.close()
                raise ServerError(f"{self.what} stopped while starting ({self.exit_text()}): {self.last_error()} "
                                  f"(its output: {self.log_path})", tail=self.log_tail())  # fmt: skip
            if health(self.url) == "ok":
                return
            if time.monotonic() > deadline:
                state = self.state()
                self.close()
                raise ServerError(
                    f"{self.what} at {self.url} did not answer /health within {key} ({timeout:g} s); "
                    f"its process was {state} (its output: {self.log_path})",
                    tail=self.log_tail(),
                )
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its output."""
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def last_error(self) -> str:
        """The last line of its output that names an error (else its last line)."""
        lines = [line.strip() for line in self.log_tail(200).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        return (errors or lines or ["no output"])[-1][:300]

    def close(self) -> None:
        """End it and every process of its group: SIGTERM, then SIGKILL after 10 s (at once where it is stopped)."""
        with self._lock:
            if self.state() == "running":  # a stopped (hung) one is killed: it would only wake to shut down
                _signal_group(self.pid, signal.SIGTERM, signal.SIGCONT)
                try:
                    self.process.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    pass
                end = time.monotonic() + 2.0  # its children end a moment after it
                while group_members(self.pid) and time.monotonic() < end:
                    time.sleep(0.1)
            # where it ended by itself (killed), its children are orphans that do not end
            if group_members(self.pid) or self.process.poll() is None:
                _signal_group(self.pid, signal.SIGKILL)
            self.process.wait()
            if self._lifeline is not None:
                os.close(self._lifeline)  # the watcher finds the group empty and ends
                self._lifeline = None
                try:
                    self._watcher.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._watcher.kill()


def wait_for(endpoint: Endpoint, timeout: float, key: str, refused_s: float | None = REFUSED_S) -> None:
    """Return once the server at ``endpoint`` (started elsewhere) answers ``/health``; ``key`` names ``timeout``.

    A ``ServerError`` when nothing listens there for ``refused_s`` (``None``: any refusal is waited out, as for a
    server another training process started), when it has no ``/health``, or when ``timeout`` passes.
    """
    start = time.monotonic()
    refused_since, grace = None, min(refused_s or timeout, timeout)
    while True:
        stops.raise_if_stopped()
        now, answer = time.monotonic(), health(endpoint.url)
        if answer == "ok":
            return
        if answer == "404":
            raise ServerError(f"{endpoint.what} at {endpoint.url} has no route /health (404): {endpoint.url_key} "
                              f"must be {endpoint.expect}")  # fmt: skip
        if answer == "refused" and refused_s is not None:
            if refused_since is None:
                refused_since = now
                log.info("no server at %s yet (connection refused); waiting %g s for one", endpoint.url, grace)
            if now - refused_since >= grace:
                raise ServerError(f"no server at {endpoint.url} (connection refused for {grace:g} s); "
                                  f"{endpoint.absent}")  # fmt: skip
        elif answer != "refused":
            refused_since = None
        if now - start > timeout:
            raise ServerError(
                f"{endpoint.what} at {endpoint.url} did not answer /health within {key} "
                f"({timeout:g} s; it {'refused connections' if answer == 'refused' else 'was silent'})"
            )
        time.sleep(0.5)


def _signal_group(group: int, *signums: int) -> None:
    for signum in signums:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _end_with_parent() -> None:
    """Run in the server's process before it starts: it gets SIGTERM when the thread that started it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
