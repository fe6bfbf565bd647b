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

Used through ``run`` and ``Forked``, which take the command a test would give ``subprocess`` (``[sys.executable, "-m",
"amir_lightning", ...]`` or ``[sys.executable, script, ...]``) and answer as ``subprocess.run`` and ``Popen`` do.

The forking process ends when its test process does (its channel closes), and not at what a run does: it ignores
the signals a process group gets (``SHIELDED``; each fork gets back the handlers it had), a fork the system refuses
fails that run with ``OSError`` as ``Popen`` would, and a run's channel that resets is that run's end. Where it ends
anyway (SIGKILL: the OOM killer), the test waiting on one of its runs fails with ``HelperEnded``, which says how it
ended (its signal or exit status) and during which test, and the next run starts a new one, with a
``HelperRestarted`` warning that says the same. Each run is known by the number the forking process gave it, not by
its pid, which the system gives again (``docs/tests.md``).
"""

from __future__ import annotations

import gc
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
import warnings
from pathlib import Path

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

#: What a process group gets (a terminal's Ctrl-C, a hang-up, a run's ``killpg`` of its own group: the forks that do
#: not lead a session share the test process's group) and would end the forking process: it ignores them, as it ends
#: when its test process does (its channel closes), and each fork gets back what the process had at its start.
SHIELDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


def _send(channel: socket.socket, message: dict) -> None:
    channel.sendall(json.dumps(message).encode())  # one message a packet (SOCK_SEQPACKET): never split or merged


def _serve(channel: socket.socket, preload: list[str]) -> tuple[dict, list[int], socket.socket, dict] | None:
    """Import, then fork one child per request until the test process goes away. Returns, in a child, its request,
    its three descriptors (stdin, stdout, stderr), its own channel here (for the ranks it launches) and the signal
    handlers this process had at its start; in this process, ``None`` when there is nothing more to do."""
    kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SHIELDED}
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # a fork's collections skip what it found imported: they wrote to every object, copying its pages
    _send(channel, {"ready": os.getpid()})
    channels = [channel]  # the test process's, then each child's
    asked_by: dict[int, tuple[socket.socket, int]] = {}  # each running child: the channel that asked for it, its id
    serial = 0
    while True:
        readable, _, _ = select.select(channels, [], [], 0.05)
        while asked_by:  # report every child that ended, by its raw wait status, to whoever asked for it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in asked_by:
                asker, ask = asked_by.pop(pid)
                try:
                    _send(asker, {"pid": pid, "id": ask, "status": status})
                except OSError:  # a run that launched ranks ended before them
                    pass
        for asker in readable:
            try:
                data, fds, _, _ = socket.recv_fds(asker, 1 << 20, 3)
            except OSError:  # ECONNRESET: a child that ended with its request unread (a rank killed with its run)
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
            try:
                pid = os.fork()
            except OSError as error:  # the process limit (EAGAIN), memory (ENOMEM): that run fails, not this process
                pid, refused = None, error
            if pid == 0:
                for other in [*channels, ours]:
                    other.close()
                return json.loads(data), fds, theirs, kept
            theirs.close()
            for fd in fds:
                os.close(fd)
            serial += 1
            if pid is None:
                ours.close()
                answer = {"started": None, "id": serial, "errno": refused.errno, "error": str(refused)}
            else:
                channels.append(ours)
                asked_by[pid] = (asker, serial)
                answer = {"started": pid, "id": serial}
            try:
                _send(asker, answer)
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


def _become(request: dict, fds: list[int], channel: socket.socket, kept: dict, base_path: list[str]) -> None:
    """In the child: the process ``python <argv>`` would be, then run it (its exit is this process's)."""
    global _forks
    _forks = Forks(channel)  # what this run forks (Lightning's ranks) comes from the forking process
    for sig, handler in kept.items():
        signal.signal(sig, handler)
    launcher = sys.modules.get("lightning.pytorch.strategies.launchers.subprocess_script")
    if launcher is not None:  # imported before the fork (PRELOAD)
        launcher.subprocess = _Launches()
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


class HelperEnded(RuntimeError):
    """The forking process ended with a run of this process unfinished or a request unanswered: how it ended (its exit
    status or signal), during which test, and its last output. The runs it had forked were killed with it."""


class HelperRestarted(UserWarning):
    """A new forking process started where the last one had ended; the message says how and during which test."""


class _Helper:
    """One forking process as the test process sees it: its channel, the runs it forked for this process and how
    they ended. ``process`` and ``log`` where this process started it; in a forked run the channel leads to the
    forking process that forked the run, and nothing restarts it."""

    def __init__(self, channel: socket.socket, process: subprocess.Popen | None = None, log=None) -> None:
        self.channel, self.process, self.log = channel, process, log
        self.answers: list[dict] = []  # answers to fork requests, not yet taken
        self.ended: dict[int, int] = {}  # each run's exit code by its id (a pid may come again), until taken
        self.running: dict[int, int] = {}  # each run still running: its pid by its id
        self.ending: str | None = None
        self._said = ""
        self._lock = threading.Lock()

    @classmethod
    def start(cls, preload: list[str]) -> _Helper:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = tempfile.TemporaryFile()
        process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno()), *preload], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=log, pass_fds=[theirs.fileno()])  # fmt: skip
        theirs.close()
        helper = cls(ours, process, log)
        threading.Thread(target=helper._watch, name="forks-watch", daemon=True).start()
        helper.next("ready", None)  # however long the imports take on a busy machine; raises if it ends first
        return helper

    def _watch(self) -> None:
        self.process.wait()
        self.end()  # names the test that runs as it ends, whether or not that test waits on one of its runs

    def end(self) -> str:
        """How it ended and during which test, found once (by the first to see it: the watching thread, or a run's
        wait that read the end of its channel); the runs of this process it still ran are killed."""
        with self._lock:
            if self.ending is None:
                how = "its channel closed"
                if self.process is not None:
                    try:
                        code = self.process.wait(timeout=30)
                    except subprocess.TimeoutExpired:  # its channel closed, yet it runs: it is of no more use
                        self.process.kill()
                        code = self.process.wait()
                    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                test = os.environ.get("PYTEST_CURRENT_TEST", "no test")
                pid = f" (pid {self.process.pid})" if self.process is not None else ""
                self.ending = f"the forking process{pid} ended ({how}) during {test}"
                for run in list(self.running.values()):  # orphans now, whose exit statuses nobody will read
                    try:
                        os.kill(run, signal.SIGKILL)
                    except OSError:
                        pass
        return self.ending

    def error(self) -> HelperEnded:
        return HelperEnded(f"{self.end()}; the runs it still ran for this process were killed with it"
                           + (f"; its last output:\n{self.said()}" if self.said() else ""))  # fmt: skip

    def said(self) -> str:
        """The end of what it wrote (its imports' warnings; a traceback where it failed)."""
        if self.log is not None and not self.log.closed:
            self.log.seek(0)
            self._said = self.log.read().decode(errors="replace")[-3000:].strip()
        return self._said

    def retire(self) -> None:
        """Once it ended and a new one took its place: what its channel still holds read (the runs that ended before
        it), then its channel and its log closed."""
        try:
            self.next("", 0)  # no message has the empty key: reads until none is left, or the end
        except HelperEnded:
            pass
        self.said()
        self.channel.close()
        if self.log is not None:
            self.log.close()

    def next(self, key: str, timeout: float | None) -> bool:
        """Read messages until one with ``key`` came (``True``) or ``timeout`` passed (``False``); ``HelperEnded``
        where the forking process ended first."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.channel.fileno() < 0:  # retired
                raise self.error()
            left = None if end is None else max(0.0, end - time.monotonic())
            readable, _, _ = select.select([self.channel], [], [], left)
            if not readable:
                return False
            try:
                data = self.channel.recv(1 << 16)
            except OSError:  # ECONNRESET: it ended with a request of this process unread
                data = b""
            if not data:
                raise self.error()
            message = json.loads(data)
            if "pid" in message:
                self.ended[message["id"]] = os.waitstatus_to_exitcode(message["status"])
                self.running.pop(message["id"], None)
            elif "started" in message:
                if message["started"] is not None:
                    self.running[message["id"]] = message["started"]
                self.answers.append(message)
            if key in message:
                return True


class Forks:
    """The forking process, started on first use and again where it ended; it ends when this process does (its
    channel closes). ``preload``: the modules it imports (``PRELOAD``)."""

    def __init__(self, channel: socket.socket | None = None, preload: list[str] | None = None) -> None:
        """Start the forking process, or (``channel``, in a forked run) ask the one that forked this process."""
        self.lock = threading.Lock()
        self.preload = list(PRELOAD if preload is None else preload)
        self.endings: list[str] = []  # how the forking processes before this one ended
        self.helper = _Helper(channel) if channel is not None else _Helper.start(self.preload)

    def _live(self) -> _Helper:
        """The forking process, a new one where the last one ended (a ``HelperRestarted`` warning says how)."""
        if self.helper.ending is None:
            return self.helper
        if self.helper.process is None:
            raise self.helper.error()
        self.endings.append(self.helper.ending)
        warnings.warn(HelperRestarted(f"{self.helper.ending}; a new forking process starts"), stacklevel=4)
        self.helper.retire()
        self.helper = _Helper.start(self.preload)
        return self.helper

    def fork(self, argv: list[str], cwd, env: dict, fds: list[int], session: bool, ctrl_c: bool) -> tuple:
        """Fork a run: ``(helper, pid, id)``; ``OSError`` where the system refused the fork, as for ``Popen``."""
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": dict(env), "session": session, "ctrl_c": ctrl_c})
        with self.lock:
            helper = self._live()
            try:
                socket.send_fds(helper.channel, [request.encode()], fds)
            except (BrokenPipeError, ConnectionResetError):  # it ended since the last run: one more try, on a new one
                helper.end()
                helper = self._live()
                socket.send_fds(helper.channel, [request.encode()], fds)
            while not helper.answers:
                helper.next("started", None)
            answer = helper.answers.pop(0)
            if answer["started"] is None:
                raise OSError(answer["errno"], f"the forking process could not fork: {answer['error']}")
            return helper, answer["started"], answer["id"]

    def close(self) -> None:
        """End the forking process as this process's end does: its channel closes."""
        with self.lock:
            self.helper.retire()
            if self.helper.process is not None:
                self.helper.process.wait(30)

    def exit_code(self, helper: _Helper, run: int, timeout: float | None) -> int | None:
        """The exit code of run ``run`` of ``helper`` once it ended, ``None`` past ``timeout``."""
        with self.lock:
            end = None if timeout is None else time.monotonic() + timeout
            while run not in helper.ended:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not helper.next("pid", left) and run not in helper.ended:
                    return None
            return helper.ended.pop(run)


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
            self._helper, self.pid, self._id = forks().fork(list(command[1:]), cwd or os.getcwd(), env or os.environ,
                                                            [stdin, *theirs], session, ctrl_c)  # fmt: skip
        finally:
            for fd in opened:
                os.close(fd)
        self.returncode: int | None = None
        self._readers: list[threading.Thread] | None = None
        self._out: dict[str, object] = {}

    def poll(self) -> int | None:
        return self.wait(0, raising=False)

    def wait(self, timeout: float | None = None, raising: bool = True) -> int | None:
        if self.returncode is None:
            self.returncode = forks().exit_code(self._helper, self._id, timeout)
            if self.returncode is None and raising:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stacks_then_kill(self, grace_s: float = 3.0) -> tuple:
        """A run past its time: every ``amir`` process of it prints its threads' stacks (``kill -USR1``, which the
        CLI answers), then it and everything under it is killed; what it wrote, stacks included."""
        for pid in [self.pid, *descendants(self.pid)]:  # the run, and the training processes it started
            try:
                if pid == self.pid or b"amir_lightning" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(grace_s)
        for pid in [*descendants(self.pid), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return self.communicate(timeout=30)

    def communicate(self, timeout: float | None = None) -> tuple:
        """Everything the run writes to its pipes, once it ended (``TimeoutExpired`` past ``timeout``)."""
        if self._readers is None:  # once: a second call (after a timeout) waits on the same readers
            out, pipes = self._out, [(n, s) for n, s in (("stdout", self.stdout), ("stderr", self.stderr)) if s]
            self._readers = [threading.Thread(target=lambda n=n, s=s: out.__setitem__(n, s.read()), daemon=True)
                             for n, s in pipes if not s.closed]  # fmt: skip
            for reader in self._readers:
                reader.start()
        out, readers = self._out, self._readers
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
        stdout, stderr = process.stacks_then_kill()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid``, children first (from ``/proc``; empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


if __name__ == "__main__":
    # The forking process: imports, then forks; each child returns from _serve and runs its command.
    _channel = socket.socket(fileno=int(sys.argv[1]))
    _own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _base = [p for p in sys.path[1:] if p not in _own]
    _request = _serve(_channel, sys.argv[2:])
    if _request is not None:
        del _channel
        _become(*_request, base_path=_base)
