"""VLLMServerEngine against a real vLLM server on this machine: sampling, the weight push, the exact sync check, and a
fit that learns with the trainer and the server in two processes.

The engines reach the test process's servers by ``url`` (``tests/helpers/served.py``), as a user reaches a server they
started; a server that a run starts, and its end with the run, are tested in tests/e2e/test_server_processes.py and
tests/test_pending_ranks.py. The tensor-parallel server is this file's own."""

import os
from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_amir
from helpers.engines import ServerDropsHalf, ServerSwapsParts, SkipsPushes, perturb
from helpers.served import SETTINGS

from amir_lightning.engines import SamplingConfig, VLLMServerEngine
from amir_lightning.helpers.http import ServerError
from amir_lightning.loop.sampler import AHEAD, generation_seed
from amir_lightning.loop.sync import StaleEngineError, SyncCheck
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.policy import Policy

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def policy_of(model_dir) -> Policy:
    policy = Policy(HFModel(str(model_dir)))
    policy.build(torch.float32)
    return policy


def new_check(policy: Policy) -> SyncCheck:
    check = SyncCheck()
    check.set_probe(policy.tokenizer, policy.tokenizer("12+4=")["input_ids"], "16 = 12 + 4")
    return check


@pytest.fixture(scope="module")
def server(tiny_dir, served):
    """An engine at a running server of the tiny model's architecture, holding ``tiny_dir``'s weights (pushed)."""
    engine = VLLMServerEngine(url=served.url(tiny_dir), max_model_len=SETTINGS["max_model_len"])
    engine.start(tiny_dir, seed=0)
    policy = policy_of(tiny_dir)
    new_check(policy).push_and_verify(policy, engine)
    yield engine
    engine.close()


def hf_logps(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


def test_server_samples_with_the_policys_logprobs_and_the_callers_seed(server, tiny_dir):
    """Per-token sampling log-probs are the policy's at the sampling temperature; the caller's random stream fixes
    the samples (a resumed run draws the same rollout), and different prompts never share a random stream."""
    policy = policy_of(tiny_dir)
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=6)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]
    torch.manual_seed(3)
    groups = server.generate(prompts, 4, sampling)
    torch.manual_seed(3)
    again = server.generate(prompts, 4, sampling)
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in again]
    assert [c.token_ids for c in groups[0]] != [c.token_ids for c in groups[2]]  # same prompt, own seeds
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for c in group:
            assert len(c.sampling_logps) == len(c.token_ids) and c.finish_reason in ("stop", "length")
            expected = hf_logps(policy.model, prompt, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.sampling_logps), expected, rtol=0, atol=1e-4)


def test_two_ranks_sampling_the_same_prompts_ahead_never_draw_the_same_group(server):
    """2 processes sample 16 copies of one prompt x 8 ahead from one server with their generation seeds: 32 groups,
    all different. Seeds added up (a rank's 8 above the other's, a prompt's n = 8 above the one before) made rank 1's
    group i rank 0's group i + 1: 15 of 16 groups copies."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    prompts = [[5, 6, 7]] * 16
    groups = [
        tuple(tuple(c.token_ids) for c in group)
        for rank in (0, 1)
        for group in server.generate(prompts, 8, sampling, seed=generation_seed(0, 3, rank, AHEAD))
    ]
    assert len(groups) == 32 and len(set(groups)) == 32


def test_a_turn_that_ends_at_more_than_four_stop_strings_is_served(server):
    """An environment's turn ends at any digit: 10 stop strings, over the 4 vLLM's OpenAI routes take by default
    (the run's server starts with VLLM_MAX_STOP_STRINGS 256). Before, every episode's request was refused (400)."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, stop=list("0123456789"))
    groups = server.generate([[5, 6, 7]] * 4, 4, sampling, seed=1)
    assert all(not any(ch.isdigit() for ch in c.text) for group in groups for c in group)


def test_server_holds_exactly_the_pushed_weights_and_a_lost_push_stops_the_run(server, tiny_dir):
    """Each push goes through vLLM's weight-update routes; the sync check reads every tensor back from the server's
    workers (the tied LM head's packed kernel too) and finds the pushed values. A push the server never gets, or gets
    half of, is caught at once."""
    policy = policy_of(tiny_dir)
    check = new_check(policy)
    before = server.pushes
    first = check.push_and_verify(policy, server)
    assert first.verified > 0 and first.gap < 1e-4
    for seed in (1, 2):
        perturb(policy.model, 0.01, seed=seed)  # an optimiser step
        report = check.push_and_verify(policy, server)
        assert report.verified == first.verified and report.gap < 1e-4
    assert server.pushes == before + 3
    perturb(policy.model, 0.01, seed=3)
    with pytest.raises(StaleEngineError, match="holds other weights"):
        check.push_and_verify(policy, SkipsPushes(server))


def test_a_server_that_gets_half_a_push_is_stopped(tiny_dir, server):
    policy = policy_of(tiny_dir)
    engine = ServerDropsHalf(url=server.url, max_model_len=SETTINGS["max_model_len"])
    engine.start(tiny_dir, seed=0)
    try:
        perturb(policy.model, 0.01, seed=4)
        with pytest.raises(StaleEngineError, match="holds other weights"):
            new_check(policy).push_and_verify(policy, engine)
    finally:
        engine.close()
        # The server goes on to other tests' runs, which sample before their first push: whole weights again (the
        # torn push left it sampling non-finite log-probs).
        new_check(policy).push_and_verify(policy, server)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two vLLM CPU workers need a core each")
def test_a_tensor_parallel_server_is_verified_exactly_and_stopped_when_k_and_v_are_exchanged(tiny_dir, monkeypatch):
    """A real TP 2 vLLM CPU server: the tiny model's one KV head is replicated on both workers, its vocabulary and
    its row-parallel weights split. Three correct pushes verify every tensor (an order-free sum over the workers
    stopped this engine at its first sync); the fourth sends k and v exchanged, and is stopped."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM binds CPU workers to NUMA nodes; here: one core each
    policy = policy_of(tiny_dir)
    engine = ServerSwapsParts(parts="kv", good_pushes=3, tensor_parallel_size=2, **SETTINGS)
    engine.start(tiny_dir, seed=0)
    try:
        check = new_check(policy)
        for sync in range(3):
            report = check.push_and_verify(policy, engine)
            assert report.verified == 16 and report.gap < 1e-4
            perturb(policy.model, 0.01, seed=sync)
        with pytest.raises(StaleEngineError, match=r"the first: model\.layers\.0\.self_attn\.qkv_proj\.weight"):
            check.push_and_verify(policy, engine)
    finally:
        engine.close()


def test_a_fit_with_the_server_engine_learns_the_tiny_task(tmp_path, served):
    """configs/tiny.yaml with its rollouts from a vLLM server in a second process: every sync verified exactly, the
    copy-a-digit reward rises, and validation runs before and during the fit (no distributed group exists in the
    trainer here, unlike with an in-process engine: evaluation still runs under no_grad)."""
    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--data.engine", served.tiny_yaml_engine()]
    args += ["--validate_before_fit", "true", "--trainer.check_val_every_n_epoch", "10"]
    run_amir([*args, "--trainer.max_epochs", "20"], tmp_path)
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    reward = scalars["rollout/reward_mean"]
    assert len(reward) == 20
    assert sum(reward[-5:]) / 5 > sum(reward[:3]) / 3 + 0.1, reward
    assert min(scalars["rollout/sync_verified_tensors"]) > 0
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-4
    assert len(scalars["val/accuracy"]) == 3  # before the fit, after rollouts 10 and 20


def test_a_server_left_with_non_finite_weights_is_named_when_a_run_reaches_it(tiny_dir, server):
    """A server at a given ``url`` keeps what the last run pushed. Left with a NaN weight (a push an earlier run left
    half done), a run that reaches it stops at its start with what to do, not the server's JSON error alone."""
    policy = policy_of(tiny_dir)
    broken = policy_of(tiny_dir)
    with torch.no_grad():
        broken.model.model.norm.weight[0] = float("nan")
    try:
        with broken.export_weights() as named:
            server.load_weights(named)
        reaching = VLLMServerEngine(url=server.url, max_model_len=SETTINGS["max_model_len"])
        with pytest.raises(ServerError, match=r"give non-finite log-probs \(a push an earlier run left half done\?\); "
                                              r"restart the server"):  # fmt: skip
            reaching.start(tiny_dir, seed=0)
        reaching.close()
    finally:
        new_check(policy).push_and_verify(policy, server)  # whole weights again, for the runs that come next


def test_a_push_is_written_a_tensor_at_a_time_as_safetensors_and_a_tensor_off_its_plan_leaves_no_file(tmp_path):
    """The file a server loads is written as the stream passes (its header from the plan): what ``load_file`` reads
    back is what was sent, in every dtype a push carries; a tensor that is not the planned one stops the push."""
    from safetensors.torch import load_file

    from amir_lightning.engines.server_setup import write_weights

    sent = {
        "a.weight": torch.randn(5, 3),
        "b.weight": torch.randn(4, dtype=torch.float64).to(torch.bfloat16),
        "c.bias": torch.arange(7, dtype=torch.int64),
        "d.scale": torch.randn(2, 2, dtype=torch.float16),
        "e.step": torch.tensor(3.0, dtype=torch.float64),  # a 0-d tensor
    }
    plan = [(name, tuple(t.shape), t.dtype) for name, t in sent.items()]
    path = tmp_path / "push.safetensors"
    write_weights(path, plan, iter(sent.items()))
    back = load_file(path)
    assert list(back) == sorted(sent) and all(torch.equal(back[k], sent[k]) and back[k].dtype == sent[k].dtype
                                              for k in sent)  # fmt: skip
    wrong = [("a.weight", sent["a.weight"]), ("b.weight", sent["b.weight"].float())]
    with pytest.raises(ValueError, match=r"the push sent \('b.weight', \(4,\), torch.float32\) where its plan has"):
        write_weights(tmp_path / "wrong.safetensors", plan, iter(wrong))
    with pytest.raises(ValueError, match="ended before its plan"):
        write_weights(tmp_path / "short.safetensors", plan, iter(list(sent.items())[:2]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["push.safetensors"]
