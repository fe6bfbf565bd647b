"""vLLM settings the run does not own, passed through (``engines/passthrough.py``): ``engine_kwargs`` reach the
in-process engine, ``server_args`` the started server's command line; the run's own settings and quantization are
refused in one line naming the key."""

from pathlib import Path

import pytest

from amir_lightning.engines import VLLMEngine, VLLMServerEngine
from amir_lightning.engines.passthrough import OWNED, server_flags, setting_errors
from amir_lightning.models import build_tiny_model

KEY = "data.engine.init_args"


@pytest.mark.parametrize("engine", [VLLMEngine, VLLMServerEngine])
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"seed": 3}, r"engine_kwargs|server_args"),
        ({"logprobs-mode": "raw_logprobs"}, r"\.logprobs-mode: set by the run: processed_logprobs"),
        ({"worker_extension_cls": "x.Y"}, r"\.worker_extension_cls: set by the run's exact read-back"),
        ({"quantization": "fp8"}, r"\.quantization: a quantized engine holds other weights than the trainer pushes"),
        (
            {"data-parallel-size": 2},
            r"\.data-parallel-size: vLLM's data-parallel serving answers /collective_rpc with "
            r"its first rank's workers alone .* set data.engine.init_args.replicas",
        ),
    ],
)
def test_a_setting_the_run_owns_or_cannot_verify_is_refused_naming_the_key(engine, setting, message):
    field = "engine_kwargs" if engine is VLLMEngine else "server_args"
    with pytest.raises(ValueError, match=message) as refused:
        engine(**{field: setting})
    assert f"{KEY}.{field}.{next(iter(setting))}" in str(refused.value)


def test_a_flag_the_started_server_sets_on_this_machine_or_a_sampling_default_is_refused():
    """On CPU the server runs without chunked prefill (a seeded prompt split over steps crashes vLLM's sampler);
    a server-side sampling default would apply to what a request leaves out."""
    with pytest.raises(ValueError, match=r"server_args\.enable-chunked-prefill: set by the run on CPU"):
        VLLMServerEngine(server_args={"enable-chunked-prefill": True})
    with pytest.raises(ValueError, match=r"server_args\.override_generation_config: set by data\.sampling"):
        VLLMServerEngine(server_args={"override_generation_config": {"repetition_penalty": 1.2}})


def test_every_owned_setting_is_refused_and_a_misspelt_one_is_named_with_the_closest():
    assert len(setting_errors(dict.fromkeys(OWNED, 1), "k", None)) == len(OWNED)
    known = {"max_num_batched_tokens", "max_num_partial_prefills", "block_size"}
    assert setting_errors({"max_num_batched_token": 8}, "k", known) == [
        "k.max_num_batched_token: vLLM has no engine setting 'max_num_batched_token' (did you mean "
        "max_num_batched_tokens?)"
    ]
    assert setting_errors({"max-num-batched-tokens": 8, "block_size": 16}, "k", known) == []


def test_server_args_are_flags_of_the_started_server():
    flags = server_flags({"max_num_batched_tokens": 4096, "enable-chunked-prefill": False, "trust_remote_code": True,
                          "override_generation_config": {"temperature": 1.0}})  # fmt: skip
    assert flags == ["--max-num-batched-tokens", "4096", "--no-enable-chunked-prefill", "--trust-remote-code",
                     "--override-generation-config", '{"temperature": 1.0}']  # fmt: skip
    engine = VLLMServerEngine(server_args={"max_num_batched_tokens": 4096}, max_model_len=64)
    command = engine.server_command(Path("/models/tiny"), 8000, 0, on_gpu=False)
    assert command[-2:] == ["--max-num-batched-tokens", "4096"]
    with pytest.raises(ValueError, match=r"server_args are flags of a server started here"):
        VLLMServerEngine(url="http://127.0.0.1:9", server_args={"max_num_batched_tokens": 4096})


@pytest.mark.slow  # a vLLM engine of its own
def test_engine_kwargs_reach_vllm_and_a_name_vllm_lacks_stops_the_start(tmp_path):
    model = build_tiny_model(tmp_path / "model", seed=1)
    kwargs = {"max_model_len": 64, "kv_cache_memory_bytes": 32 * 1024**2, "progress": False}
    wrong = VLLMEngine(**kwargs, engine_kwargs={"max_num_batched_token": 1536})
    with pytest.raises(ValueError, match=r"engine_kwargs\.max_num_batched_token: vLLM has no engine setting .*did you "
                                         r"mean max_num_batched_tokens"):  # fmt: skip
        wrong.start(model, seed=0)
    engine = VLLMEngine(**kwargs, engine_kwargs={"max-num-batched-tokens": 1536})
    engine.start(model, seed=0)
    try:
        assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 1536
    finally:
        engine.close()
