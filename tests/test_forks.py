"""The forking process of ``tests/helpers/forks.py``: what it survives, and what happens where it ends anyway.

Each test starts a forking process of its own that imports nothing heavy (``preload``), in place of the test
process's: about 0.1 s, where the suite's own takes about 10 s of imports.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import forks

#: What a process group may get (a terminal's Ctrl-C and hang-up, a ``kill`` of the group), each the end of a process.
GROUP_SIGNALS = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGTERM")
#: A script that prints its handler of each.
HANDLERS = f"import signal\nprint([str(signal.getsignal(signal.Signals[name])) for name in {GROUP_SIGNALS}])\n"


@pytest.fixture
def forking(monkeypatch, tmp_path):
    """Start a forking process that imports ``json`` and ``extra`` (from ``tmp_path``, where a test writes them), as
    this process's."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    started = []

    def start(*extra: str) -> forks.Forks:
        helper = forks.Forks(preload=["json", *extra])
        started.append(helper)
        monkeypatch.setattr(forks, "_forks", helper)
        return helper

    yield start
    for helper in started:
        helper.close()


def script(tmp_path, text: str, name: str = "run.py") -> list[str]:
    (tmp_path / name).write_text(text)
    return [sys.executable, str(tmp_path / name)]


def this_test() -> str:
    return os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]


def pid_of(helper: forks.Forks) -> int:
    return helper.helper.process.pid


def test_a_killed_forking_process_is_replaced_and_the_test_it_ended_in_named(forking, tmp_path):
    """SIGKILLed between two runs (as the OOM killer ends it): the next run starts a new one and succeeds, and a
    warning names how the last one ended and during which test. Before, every later run of the test process failed
    with BrokenPipeError."""
    light = forking()
    command = script(tmp_path, "print('ran')")
    assert forks.run(command, capture_output=True, text=True).stdout == "ran\n"
    first = pid_of(light)
    os.kill(first, signal.SIGKILL)
    light.helper.process.wait(10)
    with pytest.warns(UserWarning, match=f"ended \\(killed by SIGKILL\\) during {this_test()}") as caught:
        done = forks.run(command, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, "ran\n")
    assert pid_of(light) != first and f"pid {first}" in str(caught[0].message)


def test_the_run_a_test_waits_on_fails_naming_how_and_when_the_forking_process_ended(forking, tmp_path):
    """Killed while a run goes: the wait fails at once (not at the run's end, or its timeout) with the forking
    process's signal and the test, and the run, an orphan whose exit status nobody could read, is killed."""
    light = forking()
    run = forks.Forked(script(tmp_path, "import time; time.sleep(60)"))
    os.kill(pid_of(light), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"ended \\(killed by SIGKILL\\) during {this_test()}"):
        run.wait(timeout=20)
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(run.pid):
        time.sleep(0.05)
    assert not alive(run.pid)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_signals_a_process_group_gets_leave_the_forking_process_and_its_runs_get_them(forking, tmp_path):
    """What a process group gets (a terminal's Ctrl-C, a hang-up, a run's ``killpg`` of its own group, which forks
    without a session share with the forking process and the test process) no longer ends the forking process, and
    each run still has the handlers a fresh process has. Before, SIGINT ended it (status -2), and with it the test
    process's later runs."""
    light = forking()
    pid = pid_of(light)
    for name in GROUP_SIGNALS:
        os.kill(pid, signal.Signals[name])
    time.sleep(0.2)
    command = script(tmp_path, HANDLERS)
    forked = forks.run(command, capture_output=True, text=True, timeout=30)
    fresh = subprocess.run(command, capture_output=True, text=True, timeout=30)
    assert pid_of(light) == pid and light.helper.process.poll() is None
    assert forked.stdout == fresh.stdout and "SIG_IGN" not in forked.stdout, (forked.stdout, fresh.stdout)


def test_a_fork_the_system_refuses_fails_that_run_alone(forking, tmp_path):
    """``os.fork`` failing in the forking process (EAGAIN at the process limit, ENOMEM) fails the run that asked,
    with the ``OSError`` that ``Popen`` would raise; the next run forks. Before, the error ended the forking process
    and every later run of the test process."""
    switch = tmp_path / "refuse"
    (tmp_path / "refuses_forks.py").write_text(
        "import errno, os\n"
        "fork = os.fork\n"
        "def refusing():\n"
        f"    if os.path.exists({str(switch)!r}):\n"
        "        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))\n"
        "    return fork()\n"
        "os.fork = refusing\n"
    )
    light = forking("refuses_forks")
    command = script(tmp_path, "print('ran')")
    switch.touch()
    with pytest.raises(BlockingIOError, match="could not fork"):
        forks.run(command, capture_output=True, text=True, timeout=30)
    switch.unlink()
    pid = pid_of(light)
    assert forks.run(command, capture_output=True, text=True, timeout=30).stdout == "ran\n"
    assert pid_of(light) == pid


def test_a_pid_the_system_gives_again_is_the_new_runs(monkeypatch):
    """The system gives pids again (pid_max is 32768 on many machines): a run whose pid an earlier, ended run had
    is running, not ended with the earlier one's status. The forking process's messages are played here on a channel
    of this test's own; before, the second run read as ended at once."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(forks, "_forks", forks.Forks(ours))
    command = [sys.executable, "run.py"]

    def say(**message) -> None:
        theirs.send(json.dumps(message).encode())

    try:
        say(started=4242, id=1)
        first = forks.Forked(command, stdout=subprocess.DEVNULL)
        say(pid=4242, id=1, status=0)
        assert first.wait(timeout=5) == 0
        say(started=4242, id=2)
        second = forks.Forked(command, stdout=subprocess.DEVNULL)
        assert second.poll() is None
        say(pid=4242, id=2, status=1 << 8)
        assert second.wait(timeout=5) == 1
    finally:
        for end in (ours, theirs):
            end.close()


def test_a_run_past_its_time_says_where_each_of_its_threads_waits_and_ends_with_what_it_started(forking, tmp_path):
    """A run that hangs (a collective, a server, user code) is worth a stack, not a bare timeout: its ``amir``
    processes print every thread's stack (the CLI's ``kill -USR1``), then it and the processes it started end."""
    forking()
    started = tmp_path / "child.pid"
    text = (
        "import subprocess, sys, time\n"
        "from amir_lightning.cli import _stacks_on_sigusr1\n"
        "_stacks_on_sigusr1()\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(started)!r}, 'w').write(str(child.pid))\n"
        "def waits_on_a_collective_that_never_comes():\n"
        "    print('waiting', flush=True)\n"
        "    time.sleep(60)\n"
        "waits_on_a_collective_that_never_comes()\n"
    )
    begun = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        forks.run(script(tmp_path, text), capture_output=True, text=True, timeout=8)
    assert time.monotonic() - begun < 30
    assert caught.value.output == "waiting\n"
    assert "in waits_on_a_collective_that_never_comes" in caught.value.stderr
    child = int(started.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
