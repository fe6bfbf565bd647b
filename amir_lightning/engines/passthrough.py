"""vLLM settings the run does not own, passed to the engine as given.

``engine_kwargs`` go to ``VLLMEngine``'s ``LLM(...)``, ``server_args`` to the command line of the server
``VLLMServerEngine`` starts.

The run owns the settings that decide what the engine samples and how its weights are pushed and read back: those
are refused in one line naming the key and what sets them. A quantized engine is refused too: it holds other
weights than the trainer pushes, and the sync check verifies every push exactly (``loop/sync.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

#: The settings the run owns, and what sets each.
OWNED = {
    "model": "the policy's files (model)",
    "tokenizer": "the policy's files (model)",
    "seed": "data.seed, per generation",
    "dtype": "its own init_args.dtype",
    "max_model_len": "its own init_args.max_model_len",
    "tensor_parallel_size": "its own init_args.tensor_parallel_size",
    "max_num_seqs": "its own init_args.max_num_seqs",
    "enable_prefix_caching": "its own init_args.enable_prefix_caching",
    "gpu_memory_utilization": "its own init_args.gpu_memory_utilization",
    "kv_cache_memory_bytes": "its own init_args.kv_cache_memory_bytes",
    "enforce_eager": "the run (its own init_args.enforce_eager in process; eager on CPU)",
    "enable_sleep_mode": "its own init_args.enable_sleep_mode",
    "logprobs_mode": "the run: processed_logprobs, the log-probs of the distribution sampled from",
    "weight_transfer_config": "the run's weight push",
    "worker_extension_cls": "the run's exact read-back of the pushed weights",
    "enable_lora": "model.lora with init_args.push_adapters",
    "max_loras": "model.lora with init_args.push_adapters",
    "max_lora_rank": "model.lora with init_args.push_adapters",
    "distributed_executor_backend": "the run's launch (one engine per training process)",
    "host": "its own init_args.host",
    "port": "the run (a free port)",
    "load_format": "the run: the policy's files, then every push",
    "generation_config": "data.sampling (every sampling setting comes from it; a default of the server's would apply "
    "to what a request leaves out)",
    "override_generation_config": "data.sampling (every sampling setting comes from it)",
    "api_key": "the run (its requests carry no key)",
    "enable_scale_out": "the run (the route that says which weights sampled each token)",
}
#: Refused outright: the engine would hold other weights than the trainer pushes, which no exact check can verify.
UNVERIFIABLE = {
    "quantization": "a quantized engine holds other weights than the trainer pushes, and every push is verified "
    "exactly (the sync check): quantized engines are not supported",
    "data_parallel_size": "vLLM's data-parallel serving answers /collective_rpc with its first rank's workers alone "
    "(vllm/v1/engine/core_client.py, DPLBAsyncMPClient.call_utility_async), so the other ranks' weights could not be "
    "read back: set data.engine.init_args.replicas, whose servers are each pushed to and verified",
    "api_server_count": "the run reaches one API server per replica (data.engine.init_args.replicas)",
}


def setting_name(name: str) -> str:
    """``name`` as vLLM's Python field: ``max-num-batched-tokens`` and ``max_num_batched_tokens`` alike."""
    return name.strip().lstrip("-").replace("-", "_")


def vllm_setting_names() -> set[str] | None:
    """The fields of vLLM's ``EngineArgs`` where vLLM is installed in this process; ``None`` where it is not."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return {field.name for field in dataclasses.fields(EngineArgs)}


def setting_errors(
    settings: dict[str, Any], key: str, known: set[str] | None, owned_here: dict[str, str] | None = None
) -> list[str]:
    """What is wrong with ``settings`` given as ``key``: each a line naming ``key.<name>``.

    A setting the run owns (``OWNED``, and ``owned_here``: what this engine sets on this machine), a quantization, or
    (where vLLM's ``known`` settings are at hand) a name vLLM does not have, with the names closest to it.
    """
    owned = OWNED | (owned_here or {})
    errors = []
    for given in settings:
        name = setting_name(str(given))
        where = f"{key}.{given}"
        if name in UNVERIFIABLE:
            errors.append(f"{where}: {UNVERIFIABLE[name]}")
        elif name in owned:
            errors.append(f"{where}: set by {owned[name]}, not passed through")
        elif known is not None and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            errors.append(f"{where}: vLLM has no engine setting {name!r}{hint}")
    return errors


def server_flags(settings: dict[str, Any]) -> list[str]:
    """``settings`` as the server's command-line flags: ``--name value``.

    ``true`` is a bare ``--name``, ``false`` is ``--no-name``, a list or a mapping is JSON.
    """
    flags = []
    for given, value in settings.items():
        flag = "--" + setting_name(str(given)).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
