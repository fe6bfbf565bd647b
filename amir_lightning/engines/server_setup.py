"""What ``VLLMServerEngine`` needs around its server, each fault in one line naming the key: functions of values.

The command and environment, the transfer folder and the files a push writes into it, the deadline of each request,
and reading the server's answers. The routes a push goes through are the engine's own methods (``server.py``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from amir_lightning.engines.adapters import engine_rank
from amir_lightning.engines.base import Completion, RolloutEngine
from amir_lightning.engines.passthrough import server_flags
from amir_lightning.engines.transfer import GLOO_BACKEND
from amir_lightning.engines.vllm_worker import FILE_BACKEND
from amir_lightning.helpers.http import Endpoint, ServerError, reading
from amir_lightning.helpers.serving import TRAINER_GROUP

#: ``VLLMServerEngine``, whose settings these functions read (not imported: it imports this module).
ServerEngine = RolloutEngine

KEY = "data.engine.init_args"
ADAPTER = "policy"  #: the name the server serves the policy's pushed LoRA adapters under (and the push's number)
#: What a ``url`` must be, said when its answers are not a vLLM server's.
EXPECT = (
    "a vLLM server started with VLLM_SERVER_DEV_MODE=1 AMIR_VLLM_SERVER=1 and the flags VLLMServerEngine."
    "server_command gives (the RL routes, the amir_gloo or amir_file weight transfer and its worker extension)"
)
ABSENT = f"start one with the command VLLMServerEngine.server_command gives, or drop {KEY}.url to let the run start one"
BASE_S = 120.0  # a generation request's deadline: this, plus PER_TOKEN_S for each token a sequence may write
PER_TOKEN_S = 2.0  # a decoding step of the whole batch, generously (tens of ms on a GPU)
#: Stop strings a started server takes in one request (``VLLM_MAX_STOP_STRINGS``; vLLM's default is 4).
MAX_STOP_STRINGS = 256
ROUTE_S = 600.0  # the other routes: a weight file loaded, the weights read back
#: What the server's answer to a weight update says when it could not read the pushed file.
UNREAD = ("No such file", "Permission denied", "deserializ", "Header", "safetensors")


def server_command(
    engine: ServerEngine, model_dir: Path, port: int, seed: int, on_gpu: bool, replica: int = 0
) -> list[str]:
    """The command line of ``engine``'s server (its replica number ``replica``) for ``model_dir`` on ``port``."""
    dtype = served_dtype(engine, on_gpu)
    command = [sys.executable, "-m", "amir_lightning.vllm_serve", "serve", str(model_dir)]  # vllm serve
    command += ["--host", engine.host, "--port", str(port), "--seed", str(seed), "--dtype", dtype]
    command += ["--max-model-len", str(engine.max_model_len), "--max-num-seqs", str(engine.max_num_seqs)]
    command += ["--tensor-parallel-size", str(engine.tensor_parallel_size), "--logprobs-mode", "processed_logprobs"]
    backend = {"gloo": GLOO_BACKEND, "file": FILE_BACKEND, "nccl": "nccl"}[engine.transfer]
    command += ["--weight-transfer-config", json.dumps({"backend": backend})]
    command += ["--worker-extension-cls", "amir_lightning.engines.vllm_worker.AmirWorkerExtension"]
    command += ["--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching"]
    command += ["--enable-scale-out"]  # /inference/v1/generate: which weights sampled each token
    command += ["--disable-uvicorn-access-log"]
    if engine.takes_adapters:  # one adapter at a time: the policy's, from its latest push
        command += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(engine_rank(engine.lora_rank))]
    kv_bytes = engine.kv_cache_memory_bytes
    if on_gpu:
        command += ["--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
        command += ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes else []
    else:  # a seeded request whose prompt is split over steps crashes vLLM's CPU sampler: never split prompts
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(kv_bytes or 256 * 1024**2)]
        command += ["--no-enable-chunked-prefill"]
    command += server_flags(engine.server_args)
    cores = engine.core_sets[replica]
    if cores is not None:
        command = ["taskset", "-c", cores, *command]
    return command


def owned_flags() -> dict[str, str]:
    """The flags ``server_command`` sets on this machine beyond ``passthrough.OWNED``, and why (``server_args``)."""
    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": "the run on CPU (a seeded prompt split over steps crashes vLLM's CPU sampler)"}


def served_dtype(engine: ServerEngine, on_gpu: bool) -> str:
    """The dtype ``engine``'s server computes in: ``dtype``, or for ``auto`` bf16 on a GPU and float32 on a CPU."""
    return engine.dtype if engine.dtype != "auto" else ("bfloat16" if on_gpu else "float32")


def server_env(engine: ServerEngine, replica: int = 0) -> dict[str, str]:
    """The environment of ``engine``'s started server (replica ``replica``).

    The RL routes on, the transfer backend registered in its workers, the replica's devices.
    """
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", AMIR_VLLM_SERVER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # vLLM's OpenAI routes take 4 stop strings by default; an environment's turn may end at more (a digit, a tag)
    env.setdefault("VLLM_MAX_STOP_STRINGS", str(MAX_STOP_STRINGS))
    for key in TRAINER_GROUP:  # the server's workers form a group of their own, not the trainer's
        env.pop(key, None)
    if engine.device_sets[replica] is not None:
        env["CUDA_VISIBLE_DEVICES"] = engine.device_sets[replica]
    if engine.threads is not None:
        env["OMP_NUM_THREADS"] = str(engine.threads)
    if engine.takes_adapters:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter
    return env


def make_workdir(transfer_dir: str | None) -> Path:
    """A folder of this run's own in ``transfer_dir`` (default ``/dev/shm``, else the temporary folder)."""
    base = Path(transfer_dir or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()))
    try:
        return Path(tempfile.mkdtemp(prefix="amir_vllm_server_", dir=base))
    except OSError as err:
        raise ValueError(f"{KEY}.transfer_dir {base} cannot hold the pushed weights: {err.strerror or err} (it must "
                         "be a writable folder the server also sees)") from None  # fmt: skip


#: safetensors' names of the dtypes a push may carry.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


#: A pushed tensor's name, shape and dtype, known before it comes.
Planned = tuple[str, tuple[int, ...], torch.dtype]


def write_weights(path: Path, plan: list[Planned], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The tensors of ``named`` as a safetensors file at ``path``, written as they come.

    ``plan`` (each tensor's name, shape and dtype, in order) gives the header first, so the file is written one
    tensor at a time and the pusher never holds the whole model; a tensor that is not the planned one is an error.
    A ``ServerError`` naming ``transfer_dir`` when the file cannot be written (the space is checked first).
    """
    need, free = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in plan), None
    header: dict[str, dict] = {}
    offset = 0
    for name, shape, dtype in plan:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    try:
        free = shutil.disk_usage(path.parent).free
        if need > free:  # found before writing, not after filling the file system
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with path.open("wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            planned = iter(plan)
            for name, tensor in named:
                want = next(planned, None)
                got = (name, tuple(tensor.shape), tensor.dtype)
                if want is None or (want[0], tuple(want[1]), want[2]) != got:
                    raise ValueError(f"the push sent {got} where its plan has {want}")
                f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if next(planned, None) is not None:
                raise ValueError("the push ended before its plan")
    except ValueError:
        path.unlink(missing_ok=True)
        raise
    except Exception as err:
        path.unlink(missing_ok=True)
        cause = getattr(err, "strerror", None) or str(err)
        for known in ("No space left on device", "File too large", "Permission denied", "No such file or directory",
                      "Read-only file system", "Disk quota exceeded"):  # fmt: skip
            cause = known if known in cause else cause
        room = f" and {free / 2**20:.2f} MiB are free there" if free is not None else ""
        raise ServerError(f"could not write the pushed weights to {path} ({KEY}.transfer_dir): {cause}; they need "
                          f"{need / 2**20:.2f} MiB{room}") from None  # fmt: skip


def adapter_name(push: int) -> str:
    """The name the server serves the adapters of push number ``push`` under."""
    return f"{ADAPTER}-{push}"


def deadline(engine: ServerEngine, route: str, body: dict | None, sequences: int) -> float:
    """Seconds a request may take: ``request_timeout``, else from what it asks.

    Generation: ``BASE_S`` plus ``PER_TOKEN_S`` for each token a sequence may write, times the waves the server
    decodes ``sequences`` in (``max_num_seqs`` at a time). Other routes: ``ROUTE_S``.
    """
    if engine.request_timeout is not None:
        return engine.request_timeout
    if route == "/v1/completions" and body is not None:
        waves = math.ceil(max(sequences, 1) / engine.max_num_seqs)
        return BASE_S + PER_TOKEN_S * int(body.get("max_tokens") or 16) * waves
    return ROUTE_S


def generated(endpoint: Endpoint, answer: dict, n: int) -> list[Completion]:
    """The ``n`` completions of a ``/inference/v1/generate`` answer, with the weight version of each token."""
    group = []
    route = "/inference/v1/generate"
    with reading(endpoint, route, answer):
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            ids = [int(t) for t in choice["token_ids"]]
            logps = [float(x["logprob"]) for x in choice["logprobs"]["content"]]
            versions: list[int] = []
            for span in choice["weight_versions"] or []:  # "default": the weights the server started from
                version = 0 if span["version"] == "default" else int(span["version"])
                versions += [version] * (int(span["end"]) - int(span["start"]))
            if len(logps) != len(ids) or len(versions) != len(ids):
                raise ServerError(f"{endpoint.what} at {endpoint.url} answered {route} with {len(ids)} tokens, "
                                  f"{len(logps)} log-probs and {len(versions)} weight versions: {endpoint.url_key} "
                                  f"must be {endpoint.expect}")  # fmt: skip
            reason = "length" if choice["finish_reason"] == "length" else "stop"
            group.append(Completion(ids, choice["text"], logps, reason, versions=versions))
    if len(group) != n:
        raise ServerError(f"{endpoint.what} at {endpoint.url} returned {len(group)} completions for n = {n}: "
                          f"{endpoint.url_key} must be {endpoint.expect}")  # fmt: skip
    return group


def completions(endpoint: Endpoint, answer: dict, n: int) -> list[Completion]:
    """The ``n`` completions of a ``/v1/completions`` answer (token ids and their sampling log-probs)."""
    group = []
    with reading(endpoint, "/v1/completions", answer):
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            reason = "length" if choice["finish_reason"] == "length" else "stop"
            group.append(Completion([int(t) for t in choice["token_ids"]], choice["text"], logps, reason))
    if len(group) != n:
        raise ServerError(f"{endpoint.what} at {endpoint.url} returned {len(group)} completions for n = {n}: "
                          f"{endpoint.url_key} must be {endpoint.expect}")  # fmt: skip
    return group
