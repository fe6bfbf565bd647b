"""What a grading worker (``rewards/sandbox.py``) costs to start, from a training script that imports the whole CLI
at its top as the ``amir`` console script does: the fresh interpreter the sandbox starts, against ``multiprocessing``'s
spawn of the same worker function (how workers started before: spawn runs the main script again in each child).
Prints a table.

    .venv/bin/python benchmarks/grading_workers.py        # about 30 s on 2 cores; run it on an idle machine
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = '''
import multiprocessing as mp
import resource
import sys
import time

import psutil

from amir_lightning.cli import main  # as the `amir` console script begins
from amir_lightning.rewards import sandbox


def spawned():
    """A worker as multiprocessing's spawn starts one: the same function, this script run again in the child."""
    conn, child = mp.Pipe()
    args = (child, None, "amir_lightning.rewards.grading")
    process = mp.get_context("spawn").Process(target=sandbox._worker_main, args=args)
    process.start()
    child.close()
    assert conn.recv() == "ready"
    return conn, process.pid, process


def started():
    worker = sandbox._Worker(None, sandbox.grading.grade_answer)
    return worker.conn, worker.process.pid, worker.process


if __name__ == "__main__":
    from amir_lightning.rewards import grading  # noqa: F401

    sandbox.grading = grading
    for name, start in (("the sandbox's fresh interpreter", started), ("multiprocessing spawn", spawned)):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        tick = time.perf_counter()
        conn, pid, process = start()
        seconds = time.perf_counter() - tick
        rss = psutil.Process(pid).memory_info().rss / 2**20
        conn.send(None)
        process.join() if hasattr(process, "join") else process.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        print(f"| {name} | {seconds:.2f} | {cpu:.2f} | {rss:.0f} |")
'''


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
    print("| a grading worker's start | s to ready | CPU s | MB resident |")
    print("|---|---|---|---|")
    print(done.stdout.strip())


if __name__ == "__main__":
    main()
