"""Faults of the servers a run talks to (the vLLM server engine's, the judge's) and of reward models: each case
stops the run with its exit code and one line naming the server, the route and the key, and leaves no process.

The junk servers are a stdlib HTTP server (``tests/helpers/junk_server.py``); the cases that need vLLM itself (a
server that hangs or dies, the ways a run can end, the transfer folder) are in ``tests/e2e/test_server_processes.py``.
"""

import json
import sys
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
HF = ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]
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
    return ["--data.engine", json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine",
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
     ["the vLLM server at {url} answered /collective_rpc with text/html, not JSON ('<html><body>Please "
      "sign in</body></html>'): " + EXPECT]),
    ("engine url at a server of other JSON", "json", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} answered /collective_rpc without what it must send (KeyError: 'results'; it sent "
      '{{"status": "ok", "data": []}}): ' + EXPECT]),
    ("engine url at a vLLM without the RL routes", "404", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} has no route /collective_rpc (404): " + EXPECT]),
    ("engine url at a server that answers 500", "500", (), lambda url: server_engine(url=url), 3,
     ["the vLLM server at {url} refused /collective_rpc (500): oops"]),
    ("engine url at a silent server", "silent", (), lambda url: server_engine(url=url, request_timeout=1), 3,
     ["the vLLM server at {url} did not answer /collective_rpc within 1 s "
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
    ("judge url at a silent server", "silent", MODELS, lambda url: judge(url=url, timeout_s=1), 3,
     ["the judge (judge) at {url} did not answer /v1/chat/completions within 1 s (data.rewards: judge.timeout_s); "
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

    for mode, asked in (("500", 2), ("silent", 1)):
        with JunkServer(mode, MODELS) as server:
            reward = JudgeReward(url=server.url, model="judge", retries=1, timeout_s=1)
            reward.setup()
            with pytest.raises(ServerError, match="/v1/chat/completions"):
                reward.ask(reward.messages("1+1?", "2", "2"))
        assert server.requests["/v1/chat/completions"] == asked, (mode, server.requests)


def test_a_silent_judge_is_asked_no_more_than_the_requests_in_flight():
    """The run stops after one ``timeout_s``: before, the requests queued behind those in flight were sent too, so a
    silent judge held the run for ``timeout_s`` once per ``concurrency`` completions (20 minutes at the defaults, for
    a rollout of 128)."""
    from amir_lightning.helpers.http import ServerError
    from amir_lightning.rewards import JudgeReward

    with JunkServer("silent", MODELS) as server:
        reward = JudgeReward(url=server.url, model="judge", concurrency=2, timeout_s=1)
        reward.setup()
        with pytest.raises(ServerError, match="did not answer /v1/chat/completions within 1 s"):
            reward.score(["1"] * 8, ["1"] * 8, prompts=["What is 1 + 0?"] * 8)
    assert server.requests["/v1/chat/completions"] == 2


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
    from amir_lightning.rewards.inputs import RewardInputs

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


def test_a_servers_port_is_drawn_below_the_ephemeral_range_so_no_socket_meanwhile_takes_it(monkeypatch):
    """A server binds its port seconds after the run chose it; a port of the ephemeral range may be handed meanwhile
    to any socket binding port 0 (a process group's store) and the server stops with ``Address already in use``."""
    import socket

    from amir_lightning.helpers import serving

    low = serving._ephemeral_low()
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(serving.PORTS_FROM <= port < low for port in ports) and len(ports) > 1  # drawn, not a sequence
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert not serving._bindable("127.0.0.1", taken.getsockname()[1])
        monkeypatch.setattr(serving.random.SystemRandom, "randrange", lambda self, a, b: taken.getsockname()[1])
        port = free_port("127.0.0.1")  # the drawn one is taken every time: one the kernel hands out
        assert port != taken.getsockname()[1] and port >= low
    monkeypatch.setattr(serving, "_ephemeral_low", lambda: 1024)  # no room below the range
    assert free_port("127.0.0.1") >= low
