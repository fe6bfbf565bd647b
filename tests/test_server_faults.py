"""Faults of the servers a run talks to (the vLLM server engine's, the judge's) and of reward models: each case
stops the run with its exit code and one line naming the server, the route and the key, and leaves no process.

The junk servers are a stdlib HTTP server (``tests/helpers/junk_server.py``); the cases that need vLLM itself start
the tiny model on a real server and are marked ``slow``; the ways a run with a server can end are in
``tests/helpers/server_runs.py``.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.junk_server import JunkServer

from amir_lightning.cli import main
from amir_lightning.helpers.serving import free_port

ROOT = Path(__file__).parents[1]
HELPERS = Path(__file__).parent / "helpers"
TINY = str(ROOT / "configs" / "tiny.yaml")
BASE = ["fit", "--config", TINY, "--trainer.max_epochs", "1", "--trainer.check_val_every_n_epoch", "50"]
HF = ["--data.engine", "amir_lightning.rollout.HFEngine", "--data.engine.init_args.progress", "false"]
EXPECT = "data.engine.init_args.url must be a vLLM server started with VLLM_SERVER_DEV_MODE=1 AMIR_VLLM_SERVER=1"


def fit_here(tmp_path, monkeypatch, capsys, extra) -> tuple[int, str, float]:
    """``amir fit`` in this process: (exit status, the ``amir: error:`` line or stderr, seconds)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AMIR_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["amir"])
    start = time.monotonic()
    try:
        main([*BASE, *extra])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("amir: error:")]
    return code, lines[0] if len(lines) == 1 else err, time.monotonic() - start


def server_engine(**init_args) -> list[str]:
    return ["--data.engine", json.dumps({"class_path": "amir_lightning.rollout.VLLMServerEngine",
                                         "init_args": init_args})]  # fmt: skip


def judge(**init_args) -> list[str]:
    reward = {"class_path": "amir_lightning.rewards.JudgeReward", "init_args": {"model": "judge", **init_args}}
    return [*HF, "--data.rewards", json.dumps([reward])]


MODELS = ("/v1/models",)  # the judge's server lists its model, then answers its chat requests as the mode says
# (case, junk server mode or None (nothing listens), its good routes, arguments from its url, exit status, the error
# line's parts)
CASES = [
    ("engine url where nothing listens", None, (), lambda url: server_engine(url=url, startup_timeout=3), 3,
     ["no server at {url} (connection refused for 3 s); start one with the command VLLMServerEngine.server_command "
      "gives, or drop data.engine.init_args.url to let the run start one"]),
    ("engine url at a proxy's HTML page", "html", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} answered /init_weight_transfer_engine with text/html, not JSON ('<html><body>Please "
      "sign in</body></html>'): " + EXPECT]),
    ("engine url at a server of other JSON", "json", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} answered /v1/completions without what it must send (KeyError: 'choices'; it sent "
      '{{"status": "ok", "data": []}}): ' + EXPECT]),
    ("engine url at a vLLM without the RL routes", "404", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} has no route /init_weight_transfer_engine (404): " + EXPECT]),
    ("engine url at a server that answers 500", "500", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} refused /init_weight_transfer_engine (500): oops"]),
    ("engine url at a silent server", "silent", (), lambda url: server_engine(url=url, request_timeout=2), 3,
     ["the vLLM server at {url} did not answer /init_weight_transfer_engine within 2 s "
      "(data.engine.init_args.request_timeout); it was not started by this run and answers /health (busy)"]),
    ("transfer_dir not writable", "json", (), lambda url: server_engine(url=url, transfer_dir="/sys"), 2,
     ["data.engine.init_args.transfer_dir /sys cannot hold the pushed weights: Operation not permitted"]),
    ("judge url where nothing listens", None, (), lambda url: judge(url=url), 3,
     ["no server at {url} (connection refused at /v1/models); start one (vllm serve MODEL), or give "
      "data.rewards: judge.serve instead of url to let the run start one"]),
    ("judge url at a proxy's HTML page", "html", (), lambda url: judge(url=url), 3,
     ["the judge (judge) at {url} answered /v1/models with text/html, not JSON ('<html><body>Please sign in"]),
    ("judge url at a server of other JSON", "json", MODELS, lambda url: judge(url=url, retries=0), 3,
     ["the judge (judge) at {url} answered /v1/chat/completions without what it must send (KeyError: 'choices'"]),
    ("judge url at a silent server", "silent", MODELS, lambda url: judge(url=url, timeout_s=2), 3,
     ["the judge (judge) at {url} did not answer /v1/chat/completions within 2 s (data.rewards: judge.timeout_s); "
      "it was not started by this run and answers /health (busy)"]),
    ("judge url at a server that answers 500", "500", MODELS, lambda url: judge(url=url, retries=1), 3,
     ["the judge (judge) at {url} refused /v1/chat/completions (500): oops"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mode", "good", "args", "status", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_server_fault_is_one_line_naming_the_server_the_route_and_the_key(case, mode, good, args, status, expected,
                                                                           tmp_path, monkeypatch, capsys):  # fmt: skip
    """Before: 600 s of silence (nothing listening), ``amir: error: Expecting value: line 1 column 1 (char 0)``
    (HTML), tracebacks (other JSON, 404, 500, silent), an OS error without the key (transfer_dir)."""
    if mode is None:
        url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        code, line, seconds = fit_here(tmp_path, monkeypatch, capsys, args(url))
    else:
        with JunkServer(mode, good) as server:
            url = server.url
            code, line, seconds = fit_here(tmp_path, monkeypatch, capsys, args(url))
    assert code == status, line[-3000:]
    assert line.startswith("amir: error: "), line[-3000:]
    for part in expected:
        assert part.format(url=url) in line
    assert seconds < 60


def test_a_judge_server_that_fails_is_asked_again_only_where_asking_again_can_help():
    """A 500 is asked again ``retries`` times; a server that does not answer within ``timeout_s`` is not (before:
    each of ``retries + 1`` asks waited ``timeout_s``)."""
    from amir_lightning.helpers.http import ServerError
    from amir_lightning.rewards import JudgeReward

    for mode, asked in (("500", 3), ("silent", 1)):
        with JunkServer(mode, MODELS) as server:
            reward = JudgeReward(url=server.url, model="judge", retries=2, timeout_s=1)
            reward.setup()
            with pytest.raises(ServerError, match="/v1/chat/completions"):
                reward.ask(reward.messages("1+1?", "2", "2"))
        assert server.requests["/v1/chat/completions"] == asked, (mode, server.requests)


# ---------------------------------------------------------------------------------------------- reward models
def reward_model(path) -> list[str]:
    return [*HF, "--data.rewards", json.dumps([{"class_path": "amir_lightning.rewards.RewardModel",
                                                "init_args": {"model": str(path)}}])]  # fmt: skip


def test_a_causal_lm_given_as_reward_model_stops_before_the_first_rollout_in_one_line(tmp_path, monkeypatch, capsys):
    """Before: after the first rollout's generation, a traceback ending in "a classifier with several labels is not a
    reward model" (exit 1); with ``num_labels: 1`` in its config, a random score head scored every completion."""
    from amir_lightning.models import TinyModel

    path = TinyModel(alphabet="0123456789=", seed=5, cache_dir=str(tmp_path / "models")).resolve()
    code, line, _ = fit_here(tmp_path, monkeypatch, capsys, reward_model(path))
    assert code == 2, line[-3000:]
    assert line == (f"amir: error: data.rewards: reward_model.model {path} is not a sequence-classification model "
                    "(it is Qwen2ForCausalLM): its score head would be random weights")  # fmt: skip


@pytest.fixture(scope="module")
def short_reward_model(tmp_path_factory):
    """A tiny reward model of 32 positions whose tokenizer has no pad token."""
    import shutil

    from amir_lightning.models import PRINTABLE_ALPHABET, TinyModel

    built = TinyModel(alphabet=PRINTABLE_ALPHABET, head="reward", seed=3, max_position_embeddings=32,
                      cache_dir=str(tmp_path_factory.mktemp("rm"))).resolve()  # fmt: skip
    path = tmp_path_factory.mktemp("no_pad") / "model"
    shutil.copytree(built, path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = path / name
        if file.exists():
            config = json.loads(file.read_text())
            config.pop("pad_token", None)
            file.write_text(json.dumps(config))
    return str(path)


def scored(path, prompts, completions, **kwargs):
    from amir_lightning.data.base import Prompt
    from amir_lightning.rewards import RewardModel
    from amir_lightning.rewards.base import RewardInputs

    reward = RewardModel(path, **kwargs)
    inputs = RewardInputs(completions, [Prompt(question=p, answer="") for p in prompts], [[1]] * len(prompts),
                          ["stop"] * len(prompts))  # fmt: skip
    return reward, reward(inputs)


def alone(reward, text):
    import torch

    ids = reward.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -32:]
    with torch.no_grad():
        return reward.model(input_ids=ids).logits[0, 0].item()


def test_a_reward_tokenizer_without_a_pad_token_scores_each_sequence_as_alone(short_reward_model):
    """transformers gives such a tokenizer a pad token past the model's vocabulary (before: an IndexError in the
    embedding at the first batch of two lengths); the padding is masked out, so any id of the vocabulary pads."""
    reward, got = scored(short_reward_model, ["What is 2 + 2?", "1?"], ["4", "one, surely"], batch_size=2)
    assert reward.tokenizer.pad_token_id >= reward.model.get_input_embeddings().num_embeddings  # past the vocabulary
    assert got == pytest.approx([alone(reward, "What is 2 + 2?4"), alone(reward, "1?one, surely")], abs=1e-5)


def test_a_sequence_over_the_reward_models_context_is_scored_on_its_end(short_reward_model, caplog):
    """``max_length`` (4096 by default) is held to the model's 32 positions: a 60-token conversation keeps its last 32
    (before: all 60 went through a model of 32 positions)."""
    caplog.set_level("INFO")
    reward, (got,) = scored(short_reward_model, ["What is 2 + 2?"], ["4" * 46])
    assert reward.max_length == 32
    assert got == pytest.approx(alone(reward, "What is 2 + 2?" + "4" * 46), abs=1e-5)
    said = [r.getMessage() for r in caplog.records]
    assert (
        "reward_model: max_length 4096 is over the model's context (max_position_embeddings 32): sequences keep "
        "their last 32 tokens" in said
    )
    assert "reward_model: 1 of 1 sequences are over max_length 32 tokens; their ends were scored" in said


# ---------------------------------------------------------------------------------------------- real vLLM servers
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}


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


class Watched:
    """A process whose output lines are kept as they come, each with the time it came."""

    def __init__(self, command: list[str], cwd, env) -> None:
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)  # fmt: skip
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_hung_server_stops_the_run_at_its_deadline_in_one_line(tmp_path):
    run, pid, known, stopped = hung_fit(tmp_path, {"request_timeout": 20})
    code, ended = run.end()
    assert code == 3, run.text()[-3000:]
    url = run.wait_for("started the vLLM server at")[1].split(" at ")[1].split(" ")[0]
    assert run.lines[-1][1] == (f"amir: error: the vLLM server at {url} did not answer /v1/completions within 20 s "
                                f"(data.engine.init_args.request_timeout); its process {pid} is stopped (state T: "
                                "SIGSTOP or a debugger)")  # fmt: skip
    left, _ = count_after(pid, known)
    report("hung server, deadline 20 s", stop_to_exit_s=round(ended - stopped, 1), exit=code, left_after=left)
    assert left == 0


ENDINGS = ["normal", "error", "sigterm", "sigint", "sigkill", "server_sigkill"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from amir_lightning.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("ending", ENDINGS)
def test_nothing_of_a_started_server_outlives_the_run(ending, tiny_dir, tmp_path):
    """However the run ends, the server and everything it started (vLLM's engine core, the resource tracker) end
    too. SIGTERM and Ctrl-C come while a request is blocked on the stopped server, and end it at once."""
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    run = Watched([sys.executable, str(HELPERS / "server_runs.py"), ending, str(tiny_dir)], tmp_path, env)
    pid = int(run.wait_for("SERVER PID ")[1].split()[2])
    time.sleep(1.0)  # its first generation runs
    known = tree(pid)
    before = len(leftovers(pid, known))
    sent = time.monotonic()
    if ending in ("sigterm", "sigint"):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.0)  # a request waits on it
        sent = time.monotonic()
        run.process.send_signal(signal.SIGTERM if ending == "sigterm" else signal.SIGINT)
    elif ending == "sigkill":
        run.process.kill()
    elif ending == "server_sigkill":
        os.kill(pid, signal.SIGKILL)
    code, ended = run.end()
    expected = {"normal": 0, "error": 1, "sigterm": 143, "sigint": 130, "sigkill": -9, "server_sigkill": 3}[ending]
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
    from amir_lightning.rollout import VLLMServerEngine

    engine = VLLMServerEngine(**SERVER)
    engine.start(tiny_dir, seed=0)
    yield engine
    engine.close()


def pushed(tiny_dir) -> list:
    from amir_lightning.models import HFModel
    from amir_lightning.rollout.policy import Policy

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_weight_file_the_server_cannot_read_is_one_line_naming_transfer_dir(server, tiny_dir, monkeypatch):
    """The server does not see the trainer's transfer folder (another machine, another container): the file is gone
    when it loads it. Before: a traceback ending in the server's 500 answer, naming neither the file's folder nor
    transfer_dir. Last of the module: the failed load leaves the server's engine broken."""
    from amir_lightning.helpers.http import ServerError

    post = server._post

    def elsewhere(route, body=None):
        if route == "/update_weights":
            Path(body["update_info"]["path"]).unlink()
        return post(route, body)

    monkeypatch.setattr(server, "_post", elsewhere)
    with pytest.raises(ServerError) as caught:
        server.load_weights(pushed(tiny_dir))
    message = str(caught.value)
    assert message.startswith(f"the vLLM server at {server.url} refused /update_weights (500): ")
    assert "No such file or directory" in message and "\n" not in message
    assert message.endswith(f"it could not read the pushed weights {server._workdir}/push_{server.pushes + 1}"
                            ".safetensors: the server "
                            "must see data.engine.init_args.transfer_dir at the same path (the same machine, or a "
                            "shared file system)")  # fmt: skip
