"""A process that has imported what ``amir`` imports, forked once for each run a test needs in a process of its own
(a run killed or signalled, or one that must not share this process's state).

A fresh ``python -m amir_lightning`` spends about 10 s of CPU importing lightning, transformers and vLLM before it
does anything; the suite's end-to-end runs spent most of their time there. A fork is a process of its own (its pid,
its session when asked, its signals, its pipes, its exit status) that runs ``amir``'s entry point with the test's
arguments, working directory, environment and ``sys.path``, as ``python -m amir_lightning`` would. What the forks share
is the interpreter's start: the modules imported before the fork (read from the environment the test process had)
and the hash seed. The ranks Lightning launches from a forked run are forked alike (``_Launches``). The runs that test
the start itself (the installed ``amir`` script, a wheel in a fresh venv, a vLLM server) still start a fresh
interpreter.

Used through ``run`` and ``popen``, which take the command a test would give ``subprocess`` (``[sys.executable, "-m",
"amir_lightning", ...]`` or ``[sys.executable, script, ...]``) and answer as ``subprocess.run`` and ``Popen`` do.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: What the forks find imported: ``amir``'s CLI and what a run imports before its first rollout.
PRELOAD = [
    "amir_lightning.cli",
    "lightning.pytorch",
    "transformers",
    "vllm",
    "amir_lightning.engines.vllm",
    "vllm.v1.engine.llm_engine",
    "torch.utils.tensorboard",
    "torch.distributed.checkpoint",
    "math_verify",
    "amir_lightning.rewards.judge",
    "vllm.v1.worker.cpu_model_runner",
]


# --- the forking process ------------------------------------------------------------------------------------------


def _send(channel: socket.socket, message: dict) -> None:
    channel.sendall(json.dumps(message).encode())


def _serve(channel: socket.socket) -> tuple[dict, list[int], socket.socket] | None:
    """Import, then fork one child per request until the test process goes away. Returns, in a child, its request,
    its three descriptors (stdin, stdout, stderr) and its own channel here (for the ranks it launches); in this
    process, ``None`` when there is nothing more to do."""
    for name in PRELOAD:
        importlib.import_module(name)
    _send(channel, {"ready": os.getpid()})
    channels = [channel]  # the test process's, then each child's
    asked_by: dict[int, socket.socket] = {}  # each running child: the channel that asked for it
    while True:
        readable, _, _ = select.select(channels, [], [], 0.05)
        while asked_by:  # report every child that ended, by its raw wait status, to whoever asked for it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            try:
                _send(asked_by.pop(pid), {"pid": pid, "status": status})
            except OSError:  # a run that launched ranks ended before them
                pass
        for asker in readable:
            try:
                data, fds, _, _ = socket.recv_fds(asker, 1 << 20, 3)
            except ConnectionResetError:  # a child that ended with its request unread (a rank killed with its run)
                data, fds = b"", []
            if not data:
                if asker is channel:
                    return None
                channels.remove(asker)
                asker.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                for other in [*channels, ours]:
                    other.close()
                return json.loads(data), fds, theirs
            theirs.close()
            for fd in fds:
                os.close(fd)
            channels.append(ours)
            asked_by[pid] = asker
            try:
                _send(asker, {"started": pid})
            except OSError:
                pass


class _Launches:
    """Lightning's launcher's ``subprocess`` in a forked run: the ranks it launches (this interpreter's commands) are
    forked from the forking process too, each a process of its own as ``Popen`` gives; anything else starts as it
    would."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(command, env=None, cwd=None, **kwargs):  # noqa: N802 (subprocess's name)
        if kwargs or command[0] != sys.executable:
            return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
        return Forked(command, cwd, env)


def _become(request: dict, fds: list[int], channel: socket.socket, base_path: list[str]) -> None:
    """In the child: the process ``python <argv>`` would be, then run it (its exit is this process's)."""
    global _forks
    _forks = Forks(channel)  # what this run forks (Lightning's ranks) comes from the forking process
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script.subprocess = _Launches()
    if request["session"]:
        os.setsid()
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["ctrl_c"]:  # as Python installs it where SIGINT is not ignored at start
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    argv = request["argv"]
    module = argv[1] if argv[0] == "-m" else None
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    importlib.invalidate_caches()
    import runpy

    if module:
        sys.argv = ["-m", *argv[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


# --- the test's side ----------------------------------------------------------------------------------------------


class Forks:
    """The forking process, started on first use; it ends when this process does (its channel closes)."""

    def __init__(self, channel: socket.socket | None = None) -> None:
        """Start the forking process, or (``channel``, in a forked run) ask the one that forked this process."""
        self.lock = threading.Lock()
        self.ended: dict[int, int] = {}
        self.started: list[int] = []
        self.log = None
        if channel is not None:
            self.channel = channel
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)  # fmt: skip
        theirs.close()
        self.channel = ours
        self._next("ready", 600)

    def _next(self, key: str, timeout: float | None) -> bool:
        """Read messages until one with ``key`` came (``True``) or ``timeout`` passed (``False``)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            readable, _, _ = select.select([self.channel], [], [], left)
            if not readable:
                return False
            data = self.channel.recv(1 << 16)
            if not data:
                said = ""
                if self.log is not None:
                    self.log.seek(0)
                    said = self.log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"the forking process ended:\n{said}")
            message = json.loads(data)
            if "pid" in message:
                self.ended[message["pid"]] = os.waitstatus_to_exitcode(message["status"])
            elif "started" in message:
                self.started.append(message["started"])
            if key in message:
                return True

    def fork(self, argv: list[str], cwd, env: dict, fds: list[int], session: bool, ctrl_c: bool) -> int:
        request = {"argv": argv, "cwd": str(cwd), "env": dict(env), "session": session, "ctrl_c": ctrl_c}
        with self.lock:
            socket.send_fds(self.channel, [json.dumps(request).encode()], fds)
            while not self.started:
                self._next("started", None)
            return self.started.pop(0)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.lock:
            end = None if timeout is None else time.monotonic() + timeout
            while pid not in self.ended:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not self._next("pid", left) and pid not in self.ended:
                    return None
            return self.ended[pid]


_forks: Forks | None = None


def forks() -> Forks:
    global _forks
    if _forks is None:
        _forks = Forks()
    return _forks


class Forked:
    """A forked run, answering as ``subprocess.Popen`` does (``pid``, ``stdout``, ``stderr``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``returncode``).

    ``session``: the run leads a session of its own, so that a Ctrl-C sent to its process group reaches the run and
    its workers, not pytest. ``ctrl_c``: Ctrl-C reaches the run as it reaches a terminal's foreground job. A command
    that a non-interactive shell starts in the background (``cmd &``, as CI runners may start the suite) inherits
    SIGINT ignored, and Python keeps an ignored SIGINT ignored: without it the run would never see the test's Ctrl-C.
    """

    def __init__(self, command, cwd=None, env=None, stdout=None, stderr=None, text=False, session=False,
                 ctrl_c=False) -> None:  # fmt: skip
        if command[0] != sys.executable:
            raise ValueError(f"forks run this interpreter's commands, not {command[0]}")
        self.args, opened, theirs = command, [], []
        self.stdout = self.stderr = None
        for which, how in (("stdout", stdout), ("stderr", stderr)):
            if how == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, which, open(read, encoding="utf-8", errors="replace") if text else open(read, "rb"))
                theirs.append(write)
                opened.append(write)
            elif how == subprocess.STDOUT:
                theirs.append(theirs[0])
            elif how == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_WRONLY))
                opened.append(theirs[-1])
            else:
                theirs.append(1 if which == "stdout" else 2)
        stdin = os.open(os.devnull, os.O_RDONLY)
        opened.append(stdin)
        try:
            self.pid = forks().fork(list(command[1:]), cwd or os.getcwd(), env or os.environ, [stdin, *theirs],
                                    session, ctrl_c)  # fmt: skip
        finally:
            for fd in opened:
                os.close(fd)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0, raising=False)

    def wait(self, timeout: float | None = None, raising: bool = True) -> int | None:
        if self.returncode is None:
            self.returncode = forks().exit_code(self.pid, timeout)
            if self.returncode is None and raising:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Everything the run writes to its pipes, once it ended (``TimeoutExpired`` past ``timeout``)."""
        out: dict[str, object] = {}
        pipes = [(n, s) for n, s in (("stdout", self.stdout), ("stderr", self.stderr)) if s and not s.closed]
        readers = [threading.Thread(target=lambda n=n, s=s: out.__setitem__(n, s.read()), daemon=True)
                   for n, s in pipes]  # fmt: skip
        for reader in readers:
            reader.start()
        end = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if end is None else max(0.0, end - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        for stream in (self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        return out.get("stdout"), out.get("stderr")


def run(command, cwd=None, env=None, capture_output=False, text=False, timeout=None) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a forked run: killed past ``timeout``, which raises ``TimeoutExpired``."""
    pipe = subprocess.PIPE if capture_output else None
    process = Forked(command, cwd, env, stdout=pipe, stderr=pipe, text=text)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


if __name__ == "__main__":
    # The forking process: imports, then forks; each child returns from _serve and runs its command.
    _channel = socket.socket(fileno=int(sys.argv[1]))
    _own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _base = [p for p in sys.path[1:] if p not in _own]
    _request = _serve(_channel)
    if _request is not None:
        del _channel
        _become(*_request, base_path=_base)
