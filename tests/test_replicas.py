"""``VLLMServerEngine`` over several vLLM servers of one model (``engines/replicas.py``): groups spread whole and
balanced by tokens, every push into every replica, every replica read back at every sync, and a replica that holds
other weights, falls silent or dies stopped with a line naming it."""

import os
import signal
import time

import pytest
from helpers.engines import ServerReplicaIgnoresPushesAfter, perturb
from helpers.served import SETTINGS

from amir_lightning.engines import SamplingConfig, VLLMServerEngine
from amir_lightning.engines.replicas import assign, split_settings
from amir_lightning.helpers.http import ServerError
from amir_lightning.loop.sync import StaleEngineError
from amir_lightning.models import build_tiny_model


def test_groups_go_whole_to_the_replica_with_the_fewest_tokens_so_far():
    costs = [10, 10, 10, 10, 40]
    chosen = assign(costs, 2)
    loads = [sum(c for c, r in zip(costs, chosen) if r == i) for i in range(2)]
    assert sorted(loads) == [40, 40]  # the long group alone on one replica, the four short ones on the other
    assert chosen == assign(costs, 2)  # a function of the costs, the count and the rank
    assert assign(costs, 1) == [0] * 5


def test_processes_with_one_group_each_spread_over_the_replicas():
    assert [assign([7], 3, rank)[0] for rank in range(6)] == [0, 1, 2, 0, 1, 2]


def test_equal_groups_split_evenly_over_the_replicas():
    chosen = assign([5] * 8, 4)
    assert sorted(chosen.count(i) for i in range(4)) == [2, 2, 2, 2]


def test_devices_are_cut_into_equal_runs_and_a_list_names_each_replicas():
    errors: list[str] = []
    assert split_settings("0,1,2,3", 2, "k", errors, split=True) == ["0,1", "2,3"]
    assert split_settings(["0", "1"], 2, "k", errors, split=False) == ["0", "1"]
    assert split_settings("0-1", 2, "k", errors, split=False) == ["0-1", "0-1"]  # cores shared
    assert split_settings(None, 3, "k", errors, split=True) == [None] * 3
    assert not errors
    split_settings("0,1,2", 2, "data.engine.init_args.devices", errors, split=True)
    split_settings(["0"], 2, "data.engine.init_args.cpu_cores", errors, split=False)
    assert errors == [
        "data.engine.init_args.devices '0,1,2' has 3 devices for 2 replicas: give a multiple of the replicas, or a "
        "list of each replica's",
        "data.engine.init_args.cpu_cores lists 1 settings for 2 replica(s): give one per replica",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": ["http://a:1", "http://a:1"]}, r"url lists 2 server\(s\) \(1 distinct\) for 2 replica\(s\)"),
        ({"url": ["http://a:1", "http://b:1"], "replicas": 3}, r"url lists 2 server\(s\) \(2 distinct\) for 3"),
        ({"replicas": 0}, r"data.engine.init_args.replicas must be >= 1"),
        ({"replicas": 2, "devices": "0,1,2"}, r"devices '0,1,2' has 3 devices for 2 replicas"),
    ],
)
def test_replica_settings_that_do_not_fit_are_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMServerEngine(**kwargs)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.fixture(scope="module")
def two(tiny_dir):
    """Two servers of the tiny model, started by an engine with ``replicas: 2``, each on one thread."""
    engine = VLLMServerEngine(**SETTINGS, replicas=2)
    engine.start(tiny_dir, seed=0)
    yield engine
    engine.close()


@pytest.mark.slow  # two vLLM servers
def test_every_push_reaches_every_replica_and_each_is_read_back(tiny_dir, two, monkeypatch):
    """Generation spreads a rollout's groups over both servers; each sync verifies every tensor on both (twice the
    tensors of one server), and a replica that stops taking pushes is named at its first wrong sync."""
    from test_server_engine import new_check, policy_of

    assert len(set(two.urls)) == 2 and all(r.server is not None for r in two.replicas)
    sent: list[str] = []
    for replica in two.replicas:

        def recording(route, body=None, deadline_s=None, plain=False, replica=replica, post=replica.post):
            if route == "/v1/completions" and body and body.get("n") == 2:
                sent.append(replica.url)
            return post(route, body, deadline_s, plain)

        monkeypatch.setattr(replica, "post", recording)
    groups = two.generate([[1, 2, 3]] * 6, n=2, sampling=SamplingConfig(max_new_tokens=4), seed=3)
    assert [len(g) for g in groups] == [2] * 6 and sorted(sent.count(u) for u in two.urls) == [3, 3]
    monkeypatch.undo()

    policy = policy_of(tiny_dir)
    check = new_check(policy)
    single = VLLMServerEngine(url=two.urls[0], max_model_len=SETTINGS["max_model_len"])
    single.start(tiny_dir, seed=0)
    one = new_check(policy).push_and_verify(policy, single).verified
    single.close()
    for seed in (1, 2):
        perturb(policy.model, 0.01, seed=seed)  # only a real push into both keeps the check green
        report = check.push_and_verify(policy, two)
        assert report.verified == 2 * one > 0 and report.gap < 1e-4

    faulty = ServerReplicaIgnoresPushesAfter(url=two.urls, max_model_len=SETTINGS["max_model_len"], good_pushes=1)
    faulty.start(tiny_dir, seed=0)
    check = new_check(policy)
    check.push_and_verify(policy, faulty)
    perturb(policy.model, 0.01, seed=3)
    with pytest.raises(StaleEngineError, match=rf"after weight sync 2 .*the first: replica 2 of 2 at {two.urls[1]}: "):
        check.push_and_verify(policy, faulty)
    check.push_and_verify(policy, two)  # whole weights on both again, for the tests after


@pytest.mark.slow  # two vLLM servers
def test_a_replica_that_falls_silent_or_dies_is_named_in_one_line(tiny_dir, two):
    """SIGSTOP on the second server: a request to it passes its deadline, named; SIGKILL: the next request to it
    stops at once, naming that replica and how it ended."""
    reaching = VLLMServerEngine(url=two.urls, max_model_len=SETTINGS["max_model_len"], request_timeout=5)
    reaching.start(tiny_dir, seed=0)
    sampling = SamplingConfig(max_new_tokens=2)
    second = two.replicas[1].server
    os.killpg(second.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServerError, match=r"the vLLM server \(replica 2 of 2\) at .*request_timeout"):
            reaching.generate([[1, 2]] * 2, n=1, sampling=sampling, seed=0)
    finally:
        os.killpg(second.pid, signal.SIGCONT)
    os.killpg(second.pid, signal.SIGKILL)
    second.gone_within(30)
    started = time.monotonic()
    with pytest.raises(ServerError, match=r"the vLLM server \(replica 2 of 2\)") as stopped:
        two.generate([[1, 2]] * 2, n=1, sampling=sampling, seed=0)
    assert time.monotonic() - started < 30 and "killed by SIGKILL" in str(stopped.value), stopped.value
