"""The faults of real vLLM servers (the tiny model on a server this test starts): a server that hangs (SIGSTOP) is
named in seconds and ends the run at SIGTERM or at its deadline; however the run ends, nothing of the server is
left; a transfer folder that is full, gone or not shared with the server is one line naming
``data.engine.init_args.transfer_dir``. The figures of each case are printed (``pytest -s``)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import Watched, count_after, leftovers, report, tree

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
HELPERS = Path(__file__).parents[1] / "helpers"
TINY = str(ROOT / "configs" / "tiny.yaml")
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}


def hung_fit(tmp_path, extra_init=None) -> tuple[Watched, int, set[int], float]:
    """``amir fit`` of 3 rollouts whose server is stopped (SIGSTOP) before rollout 2 samples: the run, the server's
    process, its tree then, and when the stop was sent."""
    init = {**SERVER, "at_call": 2, **(extra_init or {})}
    engine = json.dumps({"class_path": "server_runs.StopsServerAt", "init_args": init})
    args = ["fit", "--config", TINY, "--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "50"]
    path = os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONPATH=path, PYTHONUNBUFFERED="1")
    env.pop("AMIR_DEBUG", None)
    run = Watched([sys.executable, "-m", "amir_lightning", *args, "--data.engine", engine], tmp_path, env)
    _, started = run.wait_for("started the vLLM server at")
    pid = int(started.split("(process ")[1].split(";")[0])
    stopped, _ = run.wait_for("test: SIGSTOP sent to the vLLM server")
    return run, pid, tree(pid), stopped


def test_a_hung_server_is_named_in_seconds_and_sigterm_ends_the_run_at_once_resumably(tmp_path):
    """The server stopped (SIGSTOP) in the middle of the run: one line names it and its process's state within
    seconds; SIGTERM then ends the run at once with exit 143 and the line naming the checkpoint, and nothing of the
    server is left. Before: silent for 150 s and more, SIGTERM ignored until SIGKILL, its engine cores left."""
    run, pid, known, stopped = hung_fit(tmp_path)
    said, line = run.wait_for("has not answered /v1/completions for")
    assert f"its process {pid} is stopped (state T: SIGSTOP or a debugger)" in line
    assert "(data.engine.init_args.request_timeout), or stops at SIGTERM" in line
    before = len(leftovers(pid, known))
    sent = time.monotonic()
    run.process.send_signal(signal.SIGTERM)
    code, ended = run.end()
    assert code == 143, run.text()[-3000:]
    last = "runs/tiny/version_0/checkpoints/last.ckpt"
    assert run.lines[-1][1] == (f"amir: stopped by SIGTERM with 1 of 3 rollouts done; the last checkpoint is {last}: "
                                "resume with the same command and --ckpt_path last")  # fmt: skip
    import torch

    assert torch.load(tmp_path / last, weights_only=True)["global_step"] == 1
    left, waited = count_after(pid, known)
    report("hung server, SIGTERM", first_line_s=round(said - stopped, 1), sigterm_to_exit_s=round(ended - sent, 1),
           exit=code, server_processes_before=before, left_after=left)  # fmt: skip
    assert said - stopped < 60 and ended - sent < 20 and left == 0


def test_a_hung_server_stops_the_run_at_its_deadline_in_one_line(tmp_path):
    run, pid, known, stopped = hung_fit(tmp_path, {"request_timeout": 10})
    code, ended = run.end()
    assert code == 3, run.text()[-3000:]
    url = run.wait_for("started the vLLM server at")[1].split(" at ")[1].split(" ")[0]
    assert run.lines[-1][1] == (f"amir: error: the vLLM server at {url} did not answer /v1/completions within 10 s "
                                f"(data.engine.init_args.request_timeout); its process {pid} is stopped (state T: "
                                "SIGSTOP or a debugger)")  # fmt: skip
    left, _ = count_after(pid, known)
    report("hung server, deadline 10 s", stop_to_exit_s=round(ended - stopped, 1), exit=code, left_after=left)
    assert left == 0


#: SIGTERM while a request waits on the stopped server is the first test's case, which counts what is left too; a run
#: that ends normally leaves nothing of its server in tests/test_server_engine.py (the fit that learns the tiny task),
#: and one SIGKILLed mid-generation nothing of its server in tests/e2e/test_stops.py (the kill in flight).
ENDINGS = ["error", "sigint", "server_sigkill"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from amir_lightning.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.mark.parametrize("ending", ENDINGS)
def test_nothing_of_a_started_server_outlives_the_run(ending, tiny_dir, tmp_path):
    """However the run ends, the server and everything it started (vLLM's engine core, the resource tracker) end
    too. Ctrl-C comes while a request is blocked on the stopped server, and ends it at once."""
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    run = Watched([sys.executable, str(HELPERS / "server_runs.py"), ending, str(tiny_dir)], tmp_path, env)
    pid = int(run.wait_for("SERVER PID ")[1].split()[2])
    time.sleep(1.0)  # its first generation runs
    known = tree(pid)
    before = len(leftovers(pid, known))
    sent = time.monotonic()
    if ending == "sigint":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.0)  # a request waits on it
        sent = time.monotonic()
        run.process.send_signal(signal.SIGINT)
    elif ending == "server_sigkill":
        os.kill(pid, signal.SIGKILL)
    code, ended = run.end()
    expected = {"error": 1, "sigint": 130, "server_sigkill": 3}[ending]
    assert code == expected, run.text()[-3000:]
    if ending == "server_sigkill":
        assert "ServerError: the vLLM server at http://127.0.0.1:" in run.text()
        assert "died while answering /v1/completions (killed by SIGKILL; its output: " in run.text()
    left, waited = count_after(pid, known)
    report(f"ending {ending}", exit=code, server_processes_before=before, left_after=left,
           exit_s=round(ended - sent, 1), gone_after_exit_s=round(waited, 1))  # fmt: skip
    assert left == 0


@pytest.fixture(scope="module")
def server(tiny_dir):
    from amir_lightning.engines import VLLMServerEngine

    engine = VLLMServerEngine(**SERVER, transfer="file")  # what these tests fill and break: its folder
    engine.start(tiny_dir, seed=0)
    yield engine
    engine.close()


def pushed(tiny_dir) -> list:
    from amir_lightning.models import HFModel
    from amir_lightning.models.policy import Policy

    policy = Policy(HFModel(str(tiny_dir)))
    policy.build(__import__("torch").float32)
    return list(policy.model.state_dict().items())


@pytest.fixture
def full_dir(tmp_path):
    """A file system of 64 KiB (a tmpfs; skipped where this process may not mount one)."""
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_transfer_dir_is_one_line_naming_it(server, tiny_dir, full_dir, monkeypatch):
    """Before: a safetensors traceback ending in ``No space left on device`` that named neither the file nor the
    key; now found before the write."""
    from amir_lightning.helpers.http import ServerError

    monkeypatch.setattr(server, "_workdir", full_dir)  # where the pushes go, in data.engine.init_args.transfer_dir
    with pytest.raises(ServerError) as caught:
        server.load_weights(pushed(tiny_dir))
    assert str(caught.value) == (f"could not write the pushed weights to {full_dir}/push_1.safetensors "
                                 "(data.engine.init_args.transfer_dir): No space left on device; they need 0.29 MiB "
                                 "and 0.06 MiB are free there")  # fmt: skip
    assert server.pushes == 0 and list(full_dir.iterdir()) == []


def test_a_transfer_folder_removed_under_the_run_is_one_line_naming_it(server, tiny_dir, tmp_path, monkeypatch):
    """A job's clean-up emptied ``/dev/shm`` while the run goes on."""
    from amir_lightning.helpers.http import ServerError

    gone = tmp_path / "cleaned"
    monkeypatch.setattr(server, "_workdir", gone)
    with pytest.raises(ServerError) as caught:
        server.load_weights(pushed(tiny_dir))
    assert str(caught.value) == (f"could not write the pushed weights to {gone}/push_1.safetensors "
                                 "(data.engine.init_args.transfer_dir): No such file or directory; they need 0.29 "
                                 "MiB")  # fmt: skip


def test_a_weight_file_the_server_cannot_read_is_one_line_naming_transfer_dir(server, tiny_dir, monkeypatch):
    """The server does not see the trainer's transfer folder (another machine, another container): the file is gone
    when it loads it. Before: a traceback ending in the server's 500 answer, naming neither the file's folder nor
    transfer_dir. Last of the module: the failed load leaves the server's engine broken."""
    from amir_lightning.helpers.http import ServerError

    post = server.replicas[0].post

    def elsewhere(route, body=None, deadline_s=None, plain=False):
        if route == "/update_weights":
            Path(body["update_info"]["path"]).unlink()
        return post(route, body, deadline_s, plain)

    monkeypatch.setattr(server.replicas[0], "post", elsewhere)
    with pytest.raises(ServerError) as caught:
        server.load_weights(pushed(tiny_dir))
    message = str(caught.value)
    assert message.startswith(f"the vLLM server at {server.url} refused /update_weights (500): ")
    assert "No such file or directory" in message and "\n" not in message
    assert message.endswith(f"it could not read the pushed weights {server._workdir}/push_{server.pushes + 1}"
                            ".safetensors: the server "
                            "must see data.engine.init_args.transfer_dir at the same path (the same machine, or a "
                            "shared file system)")  # fmt: skip
