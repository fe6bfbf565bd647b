"""The vLLM server a run starts for its LLM judge (``JudgeReward``'s ``serve``), on devices of its own."""

from __future__ import annotations

import os
from dataclasses import dataclass

from amir_lightning.helpers import serving
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.sources import HFModel, ModelSource


@dataclass
class JudgeServer:
    """A vLLM server this run starts for the judge (``vllm serve`` on devices of its own).

    Attributes:
        model: The judge: a Hugging Face id or directory, or a model source.
        devices: GPUs it runs on (``CUDA_VISIBLE_DEVICES``, e.g. ``"7"``); ``None``: as the environment says.
        cpu_cores: CPU cores it is pinned to (``taskset -c``); ``None``: all.
        threads: Threads of its CPU kernels (``OMP_NUM_THREADS``); ``None``: as the environment says.
        dtype: ``auto`` (``bfloat16`` on GPU, ``float32`` on CPU), or a dtype vLLM knows.
        max_model_len: Longest request + reply, in tokens.
        gpu_memory_utilization: Share of each of its GPUs it may take.
        kv_cache_memory_bytes: KV-cache size (what to set on CPU; 256 MiB there by default).
        tensor_parallel_size: GPUs it spans.
        startup_timeout: Seconds it may take to answer.
    """

    model: str | ModelSource
    devices: str | None = None
    cpu_cores: str | None = None
    threads: int | None = None
    dtype: str = "auto"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        import shutil

        key, errors = "data.rewards: judge.serve", []
        check_number(errors, f"{key}.threads", self.threads, ge=1, optional=True)
        check_number(errors, f"{key}.max_model_len", self.max_model_len, ge=1)
        check_number(errors, f"{key}.gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1)
        check_number(errors, f"{key}.kv_cache_memory_bytes", self.kv_cache_memory_bytes, gt=0, optional=True)
        check_number(errors, f"{key}.tensor_parallel_size", self.tensor_parallel_size, ge=1)
        check_number(errors, f"{key}.startup_timeout", self.startup_timeout, gt=0)
        if self.cpu_cores is not None and shutil.which("taskset") is None:
            errors.append(f"{key}.cpu_cores needs the taskset command (util-linux), which this machine lacks")
        raise_errors(errors)

    def command(self, port: int, on_gpu: bool) -> list[str]:
        """The command line of the server, listening on ``port`` of this machine."""
        import sys

        source = HFModel(self.model) if isinstance(self.model, str) else self.model
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        command = [sys.executable, "-m", "amir_lightning.vllm_serve", "serve", str(source.resolve())]
        command += ["--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
        command += [
            "--max-model-len",
            str(self.max_model_len),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
        ]
        command += ["--disable-uvicorn-access-log"]
        if on_gpu:
            command += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:
            command += ["--enforce-eager", "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes or 256 * 1024**2)]
        if self.kv_cache_memory_bytes and on_gpu:
            command += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        return ["taskset", "-c", self.cpu_cores, *command] if self.cpu_cores is not None else command

    def env(self) -> dict[str, str]:
        """Its environment: not part of the training processes' group, on its own devices and threads."""
        env = {k: v for k, v in os.environ.items() if k not in serving.TRAINER_GROUP}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env
