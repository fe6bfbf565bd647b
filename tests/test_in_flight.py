"""``data.rollout.max_staleness`` N with ``partial_rollouts``: N rollouts sample while the policy trains, a push
reaches the requests in flight (vLLM's ``/pause?mode=keep``), and each token says which weights sampled it."""

import threading
import time

import pytest
import torch
from helpers.server_runs import running_requests
from transformers import AutoModelForCausalLM

from amir_lightning.data import ArithmeticPrompts
from amir_lightning.engines import HFEngine, SamplingConfig, VLLMServerEngine
from amir_lightning.engines.base import Completion
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.loop.schedule import staleness
from amir_lightning.models import build_tiny_model
from amir_lightning.systems.datamodule import RolloutDataModule

SERVER = {"max_model_len": 256, "kv_cache_memory_bytes": 32 * 1024**2, "threads": 1}
LONG = 2000  # tokens of the generation a push reaches


def test_staleness_is_counted_over_tokens_from_the_weights_that_sampled_each():
    """Trained at step 5: a completion sampled by version 3 whole, one that a push to 4 reached after 2 tokens, and
    one of a rollout whose tokens carry no versions (its rollout's, 3)."""
    spans = Completion([1, 2, 3, 4], "", [0.0] * 4, "stop", versions=[3, 3, 4, 4])
    whole = Completion([1, 2], "", [0.0] * 2, "stop", versions=[3, 3])
    untagged = Completion([1, 2], "", [0.0] * 2, "stop")
    metrics = staleness([[spans, whole], [untagged]], 3, 5, steps_per_rollout=2)
    assert metrics == {
        "rollout/staleness_rollouts": 1.0,  # the unit max_staleness bounds: pushed one rollout (2 steps) before
        "rollout/staleness_steps": 14 / 8,
        "rollout/staleness_steps_max": 2.0,
        "rollout/spanning_frac": 1 / 3,
    }


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_staleness": 2}, "max_staleness 2 needs data.rollout.partial_rollouts true"),
        ({"partial_rollouts": True}, "partial_rollouts needs data.rollout.max_staleness >= 1"),
        ({"max_staleness": 1, "partial_rollouts": True, "stale_logps": "sampler"}, "needs data.rollout.stale_logps"),
        ({"max_staleness": -1}, "data.rollout.max_staleness must be >= 0"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_keys(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutSettings(**settings)


def test_an_engine_that_cannot_take_a_push_in_flight_is_refused():
    with pytest.raises(ValueError, match="max_staleness 2 needs an engine in its own process"):
        RolloutDataModule(prompts=ArithmeticPrompts(), engine=HFEngine(progress=False),
                          rollout=RolloutSettings(max_staleness=2, partial_rollouts=True))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_push_reaches_the_requests_in_flight_and_the_tokens_say_which_weights_sampled_them(tmp_path, replicas):
    """A long generation on the server, a push while it runs: the completions' first tokens carry the version the
    server had, the rest the pushed one (which its workers hold, exactly); every token has its engine log-prob. With
    two replicas, a group on each: the push reaches both in flight, and both score as the pushed weights."""
    # 2000 tokens take ~4 s on 2 cores: the push lands inside them (240 once finished before it on a faster machine)
    model_dir = build_tiny_model(tmp_path / "model", seed=5, max_position_embeddings=LONG + 8)
    engine = VLLMServerEngine(**SERVER | {"max_model_len": LONG + 8, "replicas": replicas})
    engine.start(model_dir, seed=0, in_flight=True)
    try:
        tensors = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        engine.load_weights(tensors.items(), version=3)  # the run's weights
        sampling = SamplingConfig(max_new_tokens=LONG, temperature=1.0, generation_kwargs={"ignore_eos": True})
        out = {}
        prompts = [[5, 6, 7]] * replicas  # a group on each replica
        thread = threading.Thread(target=lambda: out.update(groups=engine.generate(prompts, 2, sampling, 11)))
        thread.start()
        deadline = time.monotonic() + 120
        while min(running_requests(url) for url in engine.urls) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # some tokens on version 3
        moved = {name: value + 0.01 for name, value in tensors.items()}
        engine.load_weights(moved.items(), version=4)
        thread.join(timeout=300)
        assert len(out["groups"]) == replicas
        for completion in (completion for group in out["groups"] for completion in group):
            versions = completion.versions
            assert len(versions) == len(completion.token_ids) == len(completion.sampling_logps) == LONG
            first_new = versions.index(4)
            assert 0 < first_new < LONG and versions == [3] * first_new + [4] * (LONG - first_new), versions
        # the server holds the pushed weights: its log-probs of a probe are the moved model's
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.load_state_dict(moved)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            expected = torch.log_softmax(model(ids).logits[0, 2:4].float(), -1)[[0, 1], [8, 9]]
        for replica in engine.replicas:
            scored = torch.tensor(replica.score([5, 6, 7], [8, 9]))
            torch.testing.assert_close(scored, expected, atol=1e-4, rtol=0)
    finally:
        engine.close()
