"""The processes a vLLM server leaves, read from ``/proc``, and a run's output lines as they come, for
``tests/e2e/test_server_processes.py`` and the kill in flight of ``tests/e2e/test_stops.py``."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from helpers import forks


def tree(pid: int) -> set[int]:
    """``pid`` and its descendants now, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = proc_stat(name)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = set(), [pid]
    while todo:
        found.add(todo[-1])
        todo += [c for c in children.get(todo.pop(), []) if c not in found]
    return found


def proc_stat(pid) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def leftovers(pid: int, known: set[int]) -> list[int]:
    """Processes left (zombies aside) of the server whose process was ``pid``: of ``known`` (its tree when the run
    went on), of its process group or session, or its watcher."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = proc_stat(name)
        try:
            with open(f"/proc/{name}/cmdline", "rb") as file:
                cmdline = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields is None or fields[0] == "Z":
            continue
        if int(name) in known or str(pid) in fields[2:4] or f"amir-server-watch {pid}" in cmdline:
            found.append(int(name))
    return found


def count_after(pid: int, known: set[int], within: float = 20.0) -> tuple[int, float]:
    """The processes of the server left ``within`` seconds (or as soon as there are none), and the seconds taken."""
    start = time.monotonic()
    while leftovers(pid, known) and time.monotonic() - start < within:
        time.sleep(0.2)
    return len(leftovers(pid, known)), time.monotonic() - start


def group_after(group: int, within: float) -> list[str]:
    """The live processes (zombies aside) of process group ``group`` ``within`` seconds on, or as soon as there are
    none: ``stat pid args`` lines, as ``ps`` writes them."""
    deadline = time.monotonic() + within
    while True:
        found = subprocess.run(["ps", "-o", "stat=,pid=,args=", "-g", str(group)], capture_output=True, text=True)
        alive = [line for line in found.stdout.splitlines() if line.strip() and not line.strip().startswith("Z")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


class Watched:
    """A process whose output lines are kept as they come, each with the time it came."""

    def __init__(self, command: list[str], cwd, env) -> None:
        self.process = forks.Forked(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, ctrl_c=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float = 300) -> tuple[float, str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for when, line in list(self.lines):
                if text in line:
                    return when, line
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r}:\n" + "\n".join(line for _, line in self.lines[-40:]))

    def end(self, timeout: float = 120) -> tuple[int, float]:
        code = self.process.wait(timeout=timeout)
        self.reader.join(10)
        return code, time.monotonic()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def report(name: str, **figures) -> None:
    """Print a test's figures (``pytest -s`` shows them)."""
    print(f"\nFIGURES {name}: {json.dumps(figures)}")
