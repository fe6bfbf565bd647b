"""Shared test set-up: offline, single-threaded, deterministic; GPU tests deselected without CUDA."""

import collections
import os

# Before any Hugging Face import: an accidental download must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The files that share vLLM servers first (``served``: a worker keeps its servers from one such file to the next
    # and stops them at its first file without), then the files with slow tests, then those with more tests (the
    # order within a file kept): pytest-xdist hands whole files to its workers in this order
    # (``--no-loadscope-reorder``, Makefile), and a long file handed out last would hold the suite's end while the
    # other worker idles.
    serving = {item.path for item in items if "served" in getattr(item, "fixturenames", ())}
    config.stash[SERVING] = serving
    slow = {item.path for item in items if "slow" in item.keywords}
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in serving, item.path not in slow, -count[item.path]))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _log_streams_open(monkeypatch):
    """A stream handler that a library added during an earlier test (vLLM's, as it is first imported) writes to that
    test's captured stream, closed once it ended: such a handler writes to this test's stderr instead (a write to
    the closed stream printed a "Logging error" traceback into the test's output)."""
    import sys

    for handler in stream_handlers():
        if getattr(handler.stream, "closed", False):
            monkeypatch.setattr(handler, "stream", sys.stderr)


def stream_handlers() -> set:
    """The plain stream handlers of every logger (files' handlers aside)."""
    import logging

    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return {h for lg in loggers for h in getattr(lg, "handlers", ()) if type(h) is logging.StreamHandler}


def run_amir(args, tmp_path, timeout=600, console_script=False, env=None):
    """Run the ``amir`` CLI in a process of its own (each gets its own in-process vLLM engine), offline: ``python -m
    amir_lightning``, forked from a process that has imported it (``tests/helpers/forks.py``).

    ``console_script`` runs the installed ``amir`` script in a fresh interpreter, as a user does (``python -m`` puts
    the working directory on ``sys.path`` by itself); ``env`` replaces this process's environment.
    """
    import subprocess
    import sys
    from pathlib import Path

    from helpers import forks

    env = dict(env or os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    if console_script:
        env.pop("PYTHONPATH", None)
    prefix = [str(Path(sys.executable).parent / "amir")] if console_script else [sys.executable, "-m", "amir_lightning"]
    cmd = [*prefix, *args]
    run = subprocess.run if console_script else forks.run
    try:
        result = run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:  # its stderr ends with where each of its threads waited (forks.run)
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s:\n{(err.stderr or '')[-12000:]}") from None
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


class RunHere:
    """What ``amir`` run in this process wrote: ``stdout``, and in ``stderr`` its own lines then its log's (INFO up:
    in this process the log goes to pytest's handler, not to the stream a run of its own writes it to)."""

    def __init__(self, stdout: str, stderr: str) -> None:
        self.stdout, self.stderr = stdout, stderr


def amir_here(args, tmp_path, monkeypatch, capsys) -> tuple[int, str, str]:
    """Run the ``amir`` CLI in this process, in ``tmp_path`` (``tests/helpers`` importable): (exit status, stdout,
    stderr).

    No interpreter to start and no vLLM to import: the runs that test what the CLI wires (loggers, callbacks, data
    checks, resume, faults) and not the engine use this with ``HF_ENGINE``; ``run_amir`` is for what needs a process.
    """
    import sys
    from pathlib import Path

    from amir_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AMIR_DEBUG", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "helpers"))
    monkeypatch.setattr(sys, "argv", ["amir"])
    # A stream handler an earlier run in this process left (Lightning's, logging's own) writes to this test's stderr,
    # not to an earlier test's, closed by now.
    for handler in stream_handlers():
        monkeypatch.setattr(handler, "stream", sys.stderr)
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def run_here(args, tmp_path, monkeypatch, capsys, caplog, expect: int = 0) -> RunHere:
    """``amir_here``, its exit status checked (``expect``), its log (INFO up) appended to its stderr."""
    import logging

    caplog.set_level(logging.INFO)
    caplog.clear()
    code, out, err = amir_here(args, tmp_path, monkeypatch, capsys)
    err += caplog.text
    if code != expect:
        raise AssertionError(f"amir {' '.join(args)} exited with {code}, not {expect}:\n{err[-4000:]}")
    return RunHere(out, err)


#: The HF engine instead of the config's vLLM engine, for runs in this process.
HF_ENGINE = ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]


def stop_and_resume(run, tmp_path, common, first_half=()):
    """4 rollouts in one run ("full"), and 2 stopped then resumed from last.ckpt for 2 more ("part"), each by
    ``run(args)`` (``run_amir`` or ``run_here``). Both must end with the same policy, bitwise; returns the checkpoint
    the resume started from."""
    import torch
    from safetensors.torch import load_file

    run([*common, "--trainer.max_epochs", "4", "--trainer.logger.init_args.name", "full"])
    run([*common, *first_half, "--trainer.max_epochs", "2", "--trainer.logger.init_args.name", "part"])
    checkpoint = tmp_path / "runs" / "part" / "version_0" / "checkpoints" / "last.ckpt"
    resume = ["--trainer.max_epochs", "4", "--trainer.logger.init_args.name", "part", "--ckpt_path", str(checkpoint)]
    run([*common, *resume])
    full = load_file(tmp_path / "runs" / "full" / "version_0" / "policy" / "model.safetensors")
    resumed = load_file(tmp_path / "runs" / "part" / "version_1" / "policy" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    return checkpoint


def started_server_pid(stderr: str) -> int:
    """The pid of the vLLM server a run started, read from its line "started the vLLM server at ... (process N; ..."."""
    return int(stderr.split("started the vLLM server at ")[1].split("(process ")[1].split(";")[0])


def read_scalars(log_dir):
    """All scalars of the TensorBoard event files under ``log_dir``: {tag: [values in step order]}."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return scalars


#: The test files that use ``served`` (set at collection).
SERVING = pytest.StashKey[set]()
_servers = None


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's tokenizer (bundled), whose own ChatML template shows no tools."""
    from transformers import AutoTokenizer

    from amir_lightning.models import BundledSmolLM2

    return AutoTokenizer.from_pretrained(BundledSmolLM2().resolve())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """vLLM servers that the runs of the test files using this fixture share by ``url`` (``tests/helpers/served.py``):
    this process's, kept from one such file to the next (they run first, ``pytest_collection_modifyitems``)."""
    global _servers
    if _servers is None:
        from helpers.served import Served

        _servers = Served(tmp_path_factory.mktemp("served"))
    return _servers


@pytest.fixture(scope="module", autouse=True)
def _served_stopped_where_unused(request):
    """A test file that shares no server stops this process's (an idle server takes about 2 % of a core)."""
    if _servers is not None and request.node.path not in request.config.stash.get(SERVING, set()):
        _servers.close()


def pytest_sessionfinish(session):
    if _servers is not None:
        _servers.close()
