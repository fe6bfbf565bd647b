"""Rollout engines on a tiny model: vLLM (real, in-process) and HF generate; weight sync and its verification."""

import math
from contextlib import contextmanager

import pytest
import torch

from amir_lightning.models import build_tiny_model
from amir_lightning.rollout import HFEngine, SamplingConfig, VLLMEngine
from amir_lightning.rollout.sync import StaleEngineError, sync_and_verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.fixture(scope="module")
def vllm_engine(tiny_dir):
    engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)
    engine.start(tiny_dir, seed=0)
    return engine


class PolicyStub:
    """The two things ``sync_and_verify`` needs from the module, backed by a real transformers model."""

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
            assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
            assert c.text == stub.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            expected = hf_logps(stub.policy, prompt, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_engine_follows_changed_policy_weights(tiny_dir, vllm_engine):
    stub = PolicyStub(tiny_dir)
    prompt, answer = stub.tokenizer("5=")["input_ids"], "5"
    assert sync_and_verify(stub, vllm_engine, prompt, answer, tolerance=1e-4) < 1e-4
    with torch.no_grad():  # the "optimizer step": move every weight
        for p in stub.policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    completion = stub.tokenizer(answer, add_special_tokens=False)["input_ids"] + [stub.tokenizer.eos_token_id]
    stale = max(
        abs(a - b) for a, b in zip(vllm_engine.score(prompt, completion), stub.score_tokens(prompt, completion))
    )
    assert stale > 1e-2  # before the sync the engine still samples from the old policy
    diff = sync_and_verify(stub, vllm_engine, prompt, answer, tolerance=1e-4)
    assert diff < 1e-4
    assert math.isclose(
        vllm_engine.score(prompt, completion)[0], stub.score_tokens(prompt, completion)[0], abs_tol=1e-4
    )


def test_partial_sync_is_detected(tiny_dir, vllm_engine):
    stub = PolicyStub(tiny_dir)
    with torch.no_grad():
        for p in stub.policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    full = stub.export_weights

    @contextmanager
    def partial():  # only the first tensor reaches the engine, the rest stays stale
        with full() as named:
            yield named[:1]

    stub.export_weights = partial
    with pytest.raises(StaleEngineError, match="rollout engine is stale"):
        sync_and_verify(stub, vllm_engine, stub.tokenizer("5=")["input_ids"], "5", tolerance=1e-4)


def test_empty_weight_sync_is_refused(vllm_engine):
    with pytest.raises(ValueError, match="no tensors"):
        vllm_engine.load_weights([])
