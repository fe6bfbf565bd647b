"""Rollout engines on a tiny model: vLLM (real, in-process) and HF generate; weight sync and its verification."""

import gc
import math
import sys
from contextlib import contextmanager

import pytest
import torch
from helpers.engines import SkipsPushes, perturb

from amir_lightning.engines import HFEngine, SamplingConfig, VLLMEngine
from amir_lightning.loop.sync import StaleEngineError, SyncCheck, SyncSettings
from amir_lightning.models import build_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


#: The full collections vLLM ran while the module's engine started: (the module that asked, objects frozen then).
START_COLLECTIONS: list[tuple[str, int]] = []
#: The objects the process held as that start began.
HELD_BEFORE_START: list[int] = []


@pytest.fixture(scope="module")
def vllm_engine(tiny_dir):
    engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)

    def record(phase, info):
        if phase == "start" and info["generation"] == 2:
            START_COLLECTIONS.append((sys._getframe(1).f_globals.get("__name__", ""), gc.get_freeze_count()))

    from vllm import LLM  # noqa: F401 (imported before the record starts: only the start's collections count)

    gc.collect()  # the count below is what the process holds, not garbage an earlier test left for the collector
    HELD_BEFORE_START.append(len(gc.get_objects()))
    gc.callbacks.append(record)
    try:
        engine.start(tiny_dir, seed=0)
    finally:
        gc.callbacks.remove(record)
    return engine


def test_vllms_collections_while_the_engine_starts_skip_what_the_process_held(vllm_engine):
    """vLLM runs full collections while it loads a model, about 0.4 s each in a process that has imported lightning,
    transformers and vLLM (1.7 s of a tiny run's 8 s). The start freezes what the process held before it, so they
    scan only what vLLM makes."""
    by_vllm = [frozen for module, frozen in START_COLLECTIONS if module.startswith("vllm.")]
    assert len(by_vllm) >= 2, START_COLLECTIONS  # the loader's, before and after the weights
    assert min(by_vllm) >= 0.9 * HELD_BEFORE_START[0], (by_vllm, HELD_BEFORE_START)


class PolicyStub:
    """What ``SyncCheck`` needs from the module, backed by a real transformers model."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

        @contextmanager
        def export_weights():
            yield list(self.policy.state_dict().items())

        self.export_weights = export_weights

    @torch.no_grad()
    def score_tokens(self, prompt, completion):
        ids = torch.tensor([prompt + completion])
        logits = self.policy(ids).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist()


def hf_logps(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_generate_returns_groups_with_sampling_logprobs(engine_name, tiny_dir, vllm_engine):
    if engine_name == "vllm":
        engine = vllm_engine
    else:
        engine = HFEngine(batch_size=16, progress=False)
        engine.start(tiny_dir, seed=0)
    stub = PolicyStub(tiny_dir)
    prompts = [stub.tokenizer("3=")["input_ids"], stub.tokenizer("12+4=")["input_ids"]]
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=5)
    groups = engine.generate(prompts, n=4, sampling=sampling)
    assert [len(g) for g in groups] == [4, 4]
    eos = stub.tokenizer.eos_token_id
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert 1 <= len(c.token_ids) <= 5 and len(c.sampling_logps) == len(c.token_ids)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
            assert c.text == stub.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            expected = hf_logps(stub.policy, prompt, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.sampling_logps), expected, atol=1e-4, rtol=0)


def test_engine_follows_changed_policy_weights(tiny_dir, vllm_engine):
    stub = PolicyStub(tiny_dir)
    check = SyncCheck(SyncSettings(tolerance=1e-4))
    check.set_probe(stub.tokenizer, stub.tokenizer("5=")["input_ids"], "5")
    assert check.push_and_verify(stub, vllm_engine).gap < 1e-4
    perturb(stub.policy, 0.3, seed=0)
    assert check.gap(stub, vllm_engine) > 1e-2  # before the sync the engine still samples from the old policy
    report = check.push_and_verify(stub, vllm_engine)
    assert report.gap < 1e-4 and report.tolerance == 1e-4
    assert report.verified == 16  # every tensor the engine holds, read back: 2 layers x 7, embeddings, final norm
    prompt, completion = check.probe
    assert math.isclose(
        vllm_engine.score(prompt, completion)[0], stub.score_tokens(prompt, completion)[0], abs_tol=1e-4
    )


def test_partial_sync_is_detected(tiny_dir, vllm_engine):
    stub = PolicyStub(tiny_dir)
    perturb(stub.policy, 0.3, seed=1)
    full = stub.export_weights

    @contextmanager
    def partial():  # only the first tensor reaches the engine, the rest stays stale
        with full() as named:
            yield named[:1]

    stub.export_weights = partial
    check = SyncCheck()
    check.set_probe(stub.tokenizer, stub.tokenizer("5=")["input_ids"], "5")
    # 15 engine tensors get nothing; the embedding, pushed without its tied lm_head alias, is taken by one of the
    # engine's three copies only (its parameter, the input lookup, against the kernels that compute the logits)
    with pytest.raises(StaleEngineError, match=r"stale.*16 of 16 tensors.*embed_tokens.weight \(1 of its 3 copies"):
        check.push_and_verify(stub, vllm_engine)


def test_sync_calibration_refuses_a_different_model(tiny_dir):
    stub = PolicyStub(tiny_dir)
    perturb(stub.policy, 0.5, seed=3)  # the trainer's "initial" policy is not the engine's model
    engine = SkipsPushes(HFEngine(progress=False))
    engine.engine.start(tiny_dir, seed=0)
    check = SyncCheck(SyncSettings(verify_weights=False))  # the probe alone: the weights would differ too
    check.set_probe(stub.tokenizer, stub.tokenizer("12+4=")["input_ids"], "16 = 12 + 4")
    with pytest.raises(StaleEngineError, match="do not run the same model"):
        check.push_and_verify(stub, engine)


def test_empty_weight_sync_is_refused(vllm_engine):
    with pytest.raises(ValueError, match="no tensors"):
        vllm_engine.load_weights([])


def test_a_tensor_parallel_in_process_engine_is_refused_before_it_starts():
    """Its weight stream cannot reach tensor-parallel worker processes (vLLM pickles what a collective call sends, and
    a generator cannot be pickled): one line naming the key and the engine that can, before anything starts."""
    with pytest.raises(ValueError, match="tensor_parallel_size 2: the in-process VLLMEngine .*VLLMServerEngine"):
        VLLMEngine(tensor_parallel_size=2, max_model_len=64, progress=False)


def reshaped_logps(model, prompt, completion, temperature, min_p=0.0, repetition_penalty=1.0):
    """Log-probs of ``completion`` under the distribution vLLM and transformers sample from, computed here: the
    repetition penalty on every token seen so far (prompt and completion), then the temperature, then min_p's cut
    (below ``min_p`` times the top probability) and renormalisation."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].clone()  # [T, V]
    for t in range(len(completion)):
        seen = torch.tensor(sorted(set(prompt + completion[:t])))
        row = logits[t, seen]
        logits[t, seen] = torch.where(row > 0, row / repetition_penalty, row * repetition_penalty)
    probs = torch.softmax(logits / temperature, -1)
    probs = torch.where(probs >= min_p * probs.max(-1, keepdim=True).values, probs, 0.0)
    logps = torch.log(probs / probs.sum(-1, keepdim=True))
    return logps.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_min_p_and_the_repetition_penalty_reach_the_sampler_and_its_log_probs(engine_name, tiny_dir, vllm_engine):
    """``data.sampling.min_p`` and ``repetition_penalty`` change what is sampled, and the engines' log-probs are those
    of the distribution sampled from (what the mismatch correction weighs), on prompts of different lengths."""
    engine = vllm_engine if engine_name == "vllm" else HFEngine(batch_size=16, progress=False)
    if engine_name == "hf":
        engine.start(tiny_dir, seed=0)
    stub = PolicyStub(tiny_dir)
    engine.load_weights(stub.policy.state_dict().items())  # the shared engine took other weights in earlier tests
    prompts = [stub.tokenizer("3=")["input_ids"], stub.tokenizer("12+4=")["input_ids"]]
    sampling = SamplingConfig(temperature=0.9, min_p=0.3, repetition_penalty=1.6, max_new_tokens=5)
    engine.check_sampling(sampling)
    groups = engine.generate(prompts, n=6, sampling=sampling)
    plain = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            expected = reshaped_logps(stub.policy, prompt, c.token_ids, 0.9, min_p=0.3, repetition_penalty=1.6)
            torch.testing.assert_close(torch.tensor(c.sampling_logps), expected, atol=1e-4, rtol=0)
            softmax = hf_logps(stub.policy, prompt, c.token_ids, 0.9)
            plain += (torch.tensor(c.sampling_logps) - softmax).abs().max().item()
    assert plain > 0.1  # the knobs did reshape the distribution: the plain softmax gives other numbers


@pytest.mark.parametrize("engine_name", ["vllm", "hf"])
def test_a_stop_string_ends_the_completion_after_its_tokens_and_the_text_before_it(engine_name, tiny_dir, vllm_engine):
    engine = vllm_engine if engine_name == "vllm" else HFEngine(batch_size=32, progress=False)
    if engine_name == "hf":
        engine.start(tiny_dir, seed=0)
    stub = PolicyStub(tiny_dir)
    prompt = stub.tokenizer("3=")["input_ids"]
    (group,) = engine.generate([prompt], n=32, sampling=SamplingConfig(stop=["5", "77"], max_new_tokens=6))
    stopped = 0
    for c in group:
        full = stub.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop" and c.token_ids[-1] != stub.tokenizer.eos_token_id:
            stopped += 1
            assert full.endswith(("5", "77")) and c.text == full.removesuffix("5").removesuffix("77")
            assert "5" not in full[:-1] and "77" not in full[:-1]
        else:
            assert "5" not in full and "77" not in full and c.text == full
        assert len(c.sampling_logps) == len(c.token_ids)
    assert stopped >= 3  # a random tiny model writes a 5 in some of 32 completions


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (SamplingConfig(generation_kwargs={"min_tokns": 2}), "has no sampling setting 'min_tokns'"),
        (SamplingConfig(presence_penalty=0.5), "HFEngine has no presence_penalty"),
    ],
)
def test_a_sampling_setting_the_engine_lacks_is_refused_naming_it(sampling, message, tiny_dir, vllm_engine):
    hf = HFEngine(progress=False)
    with pytest.raises(ValueError, match=message):
        hf.check_sampling(sampling)
    if "min_tokns" in message:
        with pytest.raises(ValueError, match="vLLM's SamplingParams has no sampling setting 'min_tokns'"):
            vllm_engine.check_sampling(sampling)
    else:
        vllm_engine.check_sampling(sampling)  # vLLM has it
