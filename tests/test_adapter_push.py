"""LoRA adapter pushes into real vLLM (``push_adapters``): the base once, then the factors alone, verified exactly.

The policy is the real ``Policy`` with peft adapters (r 8, alpha 16: scaling 2, so a push that forgot to pre-scale
``B`` would be seen) on the tiny model; the engine is vLLM on this CPU, serving the adapter with its LoRA layers, in
this process (``VLLMEngine``) and as a server (``VLLMServerEngine``, through ``/v1/load_lora_adapter``).
"""

import json

import pytest
import torch

from amir_lightning.data import ArithmeticPrompts
from amir_lightning.engines import SamplingConfig, VLLMEngine, VLLMServerEngine
from amir_lightning.engines import replicas as replicas_module
from amir_lightning.engines import server as server_engine_module
from amir_lightning.engines import vllm as vllm_engine_module
from amir_lightning.engines.adapters import adapter_mismatches, engine_rank, modules_of
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.loop.sync import StaleEngineError, SyncCheck
from amir_lightning.models import HFModel, LoraSettings, build_tiny_model
from amir_lightning.models.policy import Policy
from amir_lightning.systems.datamodule import RolloutDataModule

LORA = LoraSettings(r=8, alpha=16)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def lora_policy(model_dir) -> Policy:
    policy = Policy(HFModel(str(model_dir)), lora=LORA)
    policy.model = policy.build(torch.float32, lora=LORA)
    step(policy, seed=0)  # B starts at zero: give every adapter a value
    return policy


def step(policy: Policy, seed: int, scale: float = 0.05) -> None:
    """An optimiser step on the adapters alone (the base is frozen)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


ENGINES = {
    "in-process": lambda: VLLMEngine(
        max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False, push_adapters=True
    ),  # fmt: skip
    # the adapter through a folder the trainer writes (transfer: file) ...
    "server": lambda: VLLMServerEngine(
        max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, threads=1, push_adapters=True, transfer="file"
    ),  # fmt: skip
    # ... and over each replica's gloo group, written by its worker on its own machine (the default transfer)
    "server replicas": lambda: VLLMServerEngine(
        max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, threads=1, push_adapters=True, replicas=2
    ),  # fmt: skip
}
#: Where each engine's adapter folder is written from (a fault below rewrites what it writes).
WRITERS = {"in-process": vllm_engine_module, "server": server_engine_module}


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(tiny_dir, request):
    engine = ENGINES[request.param]()
    engine.kind = request.param
    engine.take_adapters(LORA)
    engine.start(tiny_dir, seed=0)
    yield engine
    engine.close()


def new_check(policy: Policy) -> SyncCheck:
    check = SyncCheck()
    check.set_probe(policy.tokenizer, policy.tokenizer("3+4=")["input_ids"], "7 and 8")
    return check


@pytest.mark.slow
def test_the_base_goes_once_then_the_factors_alone_and_the_engine_computes_the_policy(tiny_dir, engine):
    policy = lora_policy(tiny_dir)
    adapters = policy.export_adapters()
    slices = len(modules_of(adapters))  # q, k, v, o, gate, up, down in each of 2 layers
    adapter_bytes = sum(t.numel() * 4 for t in adapters.values())
    base_bytes = sum(t.numel() * 4 for k, t in policy.model.state_dict().items() if "lora_" not in k)
    check = new_check(policy)
    first = check.push_and_verify(policy, engine)
    assert slices == 14 and first.pushed_bytes == base_bytes + adapter_bytes
    assert first.verified > slices and first.gap < 1e-4  # the base tensors, then every adapter slice
    for sync in range(1, 4):
        step(policy, seed=sync)
        report = check.push_and_verify(policy, engine)
        assert report.pushed_bytes == adapter_bytes and report.verified == slices * report.copies
        assert report.copies == (2 if engine.kind == "server replicas" else 1)
        assert report.gap < 1e-4, report  # float32: the engine's LoRA layers compute the policy's forward
    # What the engine samples is scored by the policy as the engine scored it.
    prompt = policy.tokenizer("12+5=")["input_ids"]
    torch.manual_seed(0)
    (completion,) = engine.generate([prompt], 1, SamplingConfig(max_new_tokens=12))[0]
    trainer = policy.score_tokens(prompt, completion.token_ids)
    assert max(abs(a - b) for a, b in zip(completion.sampling_logps, trainer)) < 1e-4


def _exchange_k_and_v(adapters):
    out = dict(adapters)
    for key in adapters:
        if ".k_proj." in key:
            out[key], out[key.replace(".k_proj.", ".v_proj.")] = (
                adapters[key.replace(".k_proj.", ".v_proj.")],
                adapters[key],
            )
    return out


def _drop_one_layer(adapters):
    return {k: v for k, v in adapters.items() if "layers.1.mlp.down_proj" not in k}


# Each fault acts on the second push (the first is correct); the check stops that sync, naming a wrong layer.
FAULTS = {
    "k and v factors exchanged": ("load", _exchange_k_and_v, "k_proj"),
    "a layer's factors left out": ("load", _drop_one_layer, "layers.1.mlp.down_proj"),
    "the push ignored": ("load", None, "proj"),
    "served with its own alpha (B scaled twice)": ("alpha", None, "proj"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS), ids=list(FAULTS))
def test_an_engine_that_takes_an_adapter_push_wrong_is_stopped_at_that_sync(tiny_dir, engine, fault, monkeypatch):
    kind, change, named = FAULTS[fault]
    policy = lora_policy(tiny_dir)
    check = new_check(policy)
    check.push_and_verify(policy, engine)
    step(policy, seed=9)
    if kind == "load":
        load = engine.load_adapters
        monkeypatch.setattr(engine, "load_adapters", lambda a, r: None if change is None else load(change(a), r))
    elif engine.kind == "server replicas":  # the worker writes the folder: it is told another alpha

        def doubled(name, tensors, rank, spec=replicas_module.adapter_spec):
            return spec(name, tensors, rank) | {"alpha": 2 * rank}

        monkeypatch.setattr(replicas_module, "adapter_spec", doubled)
    else:
        write = WRITERS[engine.kind].write_adapter

        def doubled_alpha(folder, adapters, rank, dtype):
            write(folder, adapters, rank, dtype)
            config = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 2 * rank}))

        monkeypatch.setattr(WRITERS[engine.kind], "write_adapter", doubled_alpha)
    with pytest.raises(StaleEngineError, match="holds other weights than the trainer pushed") as stopped:
        check.push_and_verify(policy, engine)
    assert named in str(stopped.value).partition("the first: ")[2], stopped.value


def test_adapter_checks_compare_each_slice_at_the_engine_rank_and_refuse_ranks_it_cannot_serve():
    class Layout:
        def adapter_place(self, module):
            return ("layers.0.qkv_proj", ["q_proj", "k_proj", "v_proj"].index(module.rsplit(".", 1)[1]))

    gen = torch.Generator().manual_seed(0)
    pushed = {}
    for part in ("q_proj", "k_proj"):
        pushed[f"base_model.model.layers.0.{part}.lora_A.weight"] = torch.randn(8, 16, generator=gen)
        pushed[f"base_model.model.layers.0.{part}.lora_B.weight"] = torch.randn(16, 8, generator=gen)

    def padded(a, b, rank=16):
        return torch.cat([a, torch.zeros(rank - 8, a.shape[1])]), torch.cat([b, torch.zeros(b.shape[0], rank - 8)], 1)

    q = padded(*(pushed[f"base_model.model.layers.0.q_proj.lora_{x}.weight"] for x in "AB"))
    k = padded(*(pushed[f"base_model.model.layers.0.k_proj.lora_{x}.weight"] for x in "AB"))
    zero = (torch.zeros(16, 16), torch.zeros(16, 16))
    assert adapter_mismatches(pushed, {"layers.0.qkv_proj": [q, k, zero]}, Layout()) == ([], 2)
    wrong, _ = adapter_mismatches(pushed, {"layers.0.qkv_proj": [k, q, zero]}, Layout())
    assert [w.split(" ")[0] for w in wrong] == ["layers.0.q_proj", "layers.0.k_proj"]
    stray = (zero[0], zero[1].clone().index_fill_(0, torch.tensor([3]), 1.0))
    assert adapter_mismatches(pushed, {"layers.0.qkv_proj": [q, k, stray]}, Layout())[0] == [
        "layers.0.qkv_proj[2] (an adapter the policy does not have)"
    ]
    junk = (q[0].clone().index_fill_(0, torch.tensor([12]), 1.0), q[1])  # nonzero past the policy's rank
    assert adapter_mismatches(pushed, {"layers.0.qkv_proj": [junk, k, zero]}, Layout())[0][0].startswith("layers.0.q_")
    assert adapter_mismatches(pushed, {"layers.0.qkv_proj": [q]}, Layout())[0] == [
        "layers.0.k_proj (not read back from the engine's adapter)"
    ]
    assert [engine_rank(r) for r in (1, 2, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="model.lora.r 600: vLLM serves adapters of rank at most 512"):
        engine_rank(600)


@pytest.mark.parametrize("kind", [VLLMEngine, VLLMServerEngine])
def test_push_adapters_without_lora_is_refused_in_one_line(kind):
    engine = kind(push_adapters=True)
    with pytest.raises(ValueError, match="push_adapters needs LoRA adapters to push \\(model.lora\\)"):
        engine.take_adapters(None)
    engine = kind()
    engine.take_adapters(LORA)
    assert not engine.takes_adapters  # merged pushes unless asked


def test_adapters_a_server_cannot_serve_right_are_refused_naming_the_keys():
    with pytest.raises(ValueError, match="push_adapters reads the served adapter back from one server worker: set "
                                         "tensor_parallel_size 1"):  # fmt: skip
        VLLMServerEngine(push_adapters=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"partial_rollouts with data.engine.init_args.push_adapters: a push in flight "
                                         r"would replace the adapter that the running requests name. Instead: push "
                                         r"merged weights \(push_adapters false"):  # fmt: skip
        RolloutDataModule(prompts=ArithmeticPrompts(), engine=VLLMServerEngine(push_adapters=True),
                          rollout=RolloutSettings(max_staleness=1, partial_rollouts=True))  # fmt: skip


@pytest.mark.slow
def test_a_run_that_pushes_adapters_resumes_to_the_same_policy_and_logs_light_syncs(
    tmp_path, monkeypatch, capsys, caplog
):
    """configs/tiny.yaml with LoRA and ``push_adapters``: the resumed run pushes its base again, then the adapters,
    and ends with the uninterrupted run's weights, bitwise; after the first sync each one moves the adapters alone."""
    from pathlib import Path

    from conftest import read_scalars, run_here, stop_and_resume

    config = Path(__file__).parents[1] / "configs" / "tiny.yaml"
    common = ["fit", "--config", str(config), "--model.lora", "{r: 8, alpha: 16}"]
    common += ["--data.engine.init_args.push_adapters", "true", "--trainer.check_val_every_n_epoch", "2"]
    stop_and_resume(lambda args: run_here(args, tmp_path, monkeypatch, capsys, caplog), tmp_path, common)
    scalars = read_scalars(tmp_path / "runs" / "full" / "version_0")
    mib, verified = scalars["rollout/sync_mib"], scalars["rollout/sync_verified_tensors"]
    assert len(mib) >= 4 and mib[0] > 4 * mib[1] and mib[1:] == [mib[1]] * (len(mib) - 1)
    assert verified[1:] == [14.0] * (len(mib) - 1) and verified[0] > 14  # each adapter slice; first the base too
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-4


@pytest.mark.slow
def test_a_run_on_a_server_pushes_adapters_and_samples_with_them(tmp_path, monkeypatch, capsys, caplog):
    """configs/tiny.yaml with LoRA, ``push_adapters`` and a vLLM server: the first sync sends the base and the
    adapters, every later one the adapters alone, each read back from the server exactly; the server's log-probs of
    what it sampled are the trainer's (the requests name the adapter: without it they would be the base model's)."""
    from pathlib import Path

    from conftest import read_scalars, run_here, started_server_pid

    from amir_lightning.helpers.serving import group_members

    config = Path(__file__).parents[1] / "configs" / "tiny.yaml"
    server = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1, "push_adapters": True}
    engine = json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": server})
    args = ["fit", "--config", str(config), "--model.lora", "{r: 8, alpha: 16}", "--data.engine", engine]
    args += ["--trainer.max_epochs", "3", "--trainer.check_val_every_n_epoch", "9"]
    run = run_here(args, tmp_path, monkeypatch, capsys, caplog)
    pid = started_server_pid(run.stderr)
    assert group_members(pid) == []  # a run in this process (a notebook's) stops its server as it ends
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    mib, verified = scalars["rollout/sync_mib"], scalars["rollout/sync_verified_tensors"]
    assert len(mib) == 3 and mib[0] > 4 * mib[1] and mib[1] == mib[2]
    assert verified[1:] == [14.0, 14.0] and verified[0] > 14
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-4
    assert max(scalars["rollout/engine_trainer_kl"]) < 1e-6  # the sampled tokens, scored by both


@pytest.mark.slow
def test_a_replica_that_misses_an_adapter_push_is_named_at_that_sync(tiny_dir, engine, monkeypatch):
    """Two servers serving the policy's adapter: the second push reaches the first replica alone, and the sync stops
    naming the second."""
    if engine.kind != "server replicas":
        pytest.skip("an engine of one copy")
    policy = lora_policy(tiny_dir)
    check = new_check(policy)
    check.push_and_verify(policy, engine)
    step(policy, seed=11)
    monkeypatch.setattr(engine, "_targets", lambda: engine.replicas[:1])
    with pytest.raises(StaleEngineError, match=rf"the first: replica 2 of 2 at {engine.urls[1]}: .*proj"):
        check.push_and_verify(policy, engine)
    monkeypatch.undo()
    check.push_and_verify(policy, engine)  # both serve the policy's adapter again
