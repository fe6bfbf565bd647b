"""Engines against the trainer's numerics, each test with engines of its own (started and closed in turn).

At temperature 1 an engine samples the policy the trainer scores and reports that distribution's log-probs; in bf16
the weight-sync check passes a correct engine and stops one that ignores pushes. Kept apart from test_engines.py:
an in-process vLLM engine that is closed takes vLLM's process-wide parallel state with it, so these run before that
module's shared engine exists.
"""

import pytest
import torch
from helpers.engines import SkipsPushes, perturb

from amir_lightning.engines import HFEngine, SamplingConfig, VLLMEngine
from amir_lightning.loop.sync import StaleEngineError, SyncCheck
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.objectives import GRPOLoss
from amir_lightning.systems.module import AmirGRPOModule

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.fixture(scope="module")
def leaky_dir(tmp_path_factory):
    """A tiny model whose generation_config.json would bend sampling (as Qwen2.5-Instruct's repetition_penalty does)
    and lists a second EOS id."""
    import json

    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path_factory.mktemp("leaky") / "model", seed=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    second_eos = tokenizer.convert_tokens_to_ids("7")
    config = {
        "eos_token_id": [tokenizer.eos_token_id, second_eos],
        "pad_token_id": tokenizer.pad_token_id,
        "do_sample": True,
        "temperature": 0.3,
        "top_k": 3,
        "repetition_penalty": 1.5,
        "no_repeat_ngram_size": 2,
    }
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    return model_dir, {tokenizer.eos_token_id, second_eos}


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_engine_samples_the_policy_the_trainer_scores(leaky_dir, engine_name):
    """At temperature 1 the engine reports the log-probs of the distribution it sampled from, and that distribution
    is the trainer's: none of the checkpoint's sampling defaults (top_k 3, repetition penalty, no-repeat n-grams)
    leak in, and generation stops on every EOS id the checkpoint lists."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, eos_ids = leaky_dir
    if engine_name == "vllm":
        engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)
    else:
        engine = HFEngine(batch_size=64, progress=False)
    engine.start(model_dir, seed=0)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [tokenizer("3=")["input_ids"], tokenizer("12+4=")["input_ids"]]
    groups = engine.generate(prompts, n=16, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6))
    outside_top3 = stopped_on = 0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logps = torch.log_softmax(policy(ids).logits[0, len(prompt) - 1 : -1], -1)  # [T, V]
            picked = logps.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.sampling_logps), picked, atol=1e-4, rtol=0)
            top3 = logps.topk(3, dim=-1).indices  # [T, 3]
            outside_top3 += int((top3 != ids[0, len(prompt) :, None]).all(-1).sum())
            assert not eos_ids & set(c.token_ids[:-1])  # nothing generated past a stop token
            assert c.finish_reason == ("stop" if c.token_ids[-1] in eos_ids else "length")
            stopped_on += c.token_ids[-1] in eos_ids - {tokenizer.eos_token_id}
    assert outside_top3 > 0  # a leaked top_k=3 would never sample outside the policy's top 3
    assert stopped_on > 0  # the second EOS id stops generation too
    engine.close()


@pytest.mark.parametrize("engine_name", ["hf", "vllm"])
def test_bf16_sync_check_passes_on_a_correct_engine_and_fails_on_a_stale_one(tiny_dir, engine_name):
    """A bf16 engine against a bf16 trainer: the probe gap at step 0 is rounding noise (a fixed 1e-3 tolerance on it
    would stop this correct run), so the probe is measured, never a stop; the weights the engine holds are compared
    exactly, so an engine that skips the pushes is stopped at the first sync after the policy moved."""
    module = AmirGRPOModule(policy=HFModel(str(tiny_dir)), loss=GRPOLoss())
    module.compute_dtype = torch.bfloat16  # what trainer.precision=bf16-mixed sets in setup()
    module.configure_model()
    if engine_name == "vllm":
        engine = VLLMEngine(dtype="bfloat16", max_model_len=64, kv_cache_memory_bytes=32 * 1024**2, progress=False)
    else:
        engine = HFEngine(dtype="bfloat16", progress=False)
    engine.start(tiny_dir, seed=0)
    prompt, answer = module.policy.tokenizer("12+4=")["input_ids"], "16 = 12 + 4 = 4 + 12 = 8 + 8"

    stale = SyncCheck()
    stale.set_probe(module.policy.tokenizer, prompt, answer)
    floor = stale.push_and_verify(module.policy, SkipsPushes(engine)).gap  # step 0: same weights, the gap is numerics
    assert floor > 1e-3 and stale.noise_floor == floor
    perturb(module.model, 0.005, seed=10)  # an optimiser step
    with pytest.raises(StaleEngineError, match="after weight sync 2 this process's engine holds other weights"):
        stale.push_and_verify(module.policy, SkipsPushes(engine))

    check = SyncCheck()
    check.set_probe(module.policy.tokenizer, prompt, answer)
    report = check.push_and_verify(module.policy, engine)
    assert report.tolerance == pytest.approx(4 * report.gap)
    for step in range(4):
        perturb(module.model, 0.005, seed=20 + step)
        assert check.push_and_verify(module.policy, engine).verified > 0
    engine.close()


def test_an_engine_left_unclosed_does_not_take_the_next_engines_parallel_state(tiny_dir):
    """An in-process run that ends without closing its engine leaves it in a reference cycle, for the garbage
    collector; vLLM's model loader collects while the next engine starts, and an engine's shutdown destroys vLLM's
    process-wide parallel groups. The next engine then failed at its first generation ("pipeline model parallel
    group is not initialized", as a test file that followed such a run did in CI). Run in a process of its own
    (``helpers/unclosed_engine.py``, forked from a process that has imported vLLM and made no engine): in this one,
    what earlier tests imported and left decides what is collectable."""
    import sys
    from pathlib import Path

    from helpers import forks

    script = Path(__file__).parent / "helpers" / "unclosed_engine.py"
    done = forks.run([sys.executable, str(script), str(tiny_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines().count("generated") == 3, done.stdout[-3000:]  # vLLM logs to stdout too
