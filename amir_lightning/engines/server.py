"""vLLM server rollout engine: generation from a vLLM server on its own devices (or CPU cores), over vLLM's own API.

    data:
      engine:
        class_path: amir_lightning.engines.VLLMServerEngine
        init_args: {devices: "6,7", max_model_len: 2048}     # or url: http://host:8000 for a server you started

The engine starts ``vllm serve`` (``python -m amir_lightning.vllm_serve serve``) with vLLM's RL routes on
(``VLLM_SERVER_DEV_MODE=1``) and talks to it over HTTP: ``/v1/completions`` samples (token ids in, token ids and
per-token sampling log-probs out) and scores the sync probe (``prompt_logprobs``); a weight push is vLLM's own
update sequence, ``/pause`` (requests in flight finish, the prefix cache is dropped), ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` with the push's number as the weight version, ``/resume``. The
weights travel over a gloo group of the trainer's first process and the server's workers (``transfer: gloo``, the
default: ``engines/transfer.py``, ``GlooWeightTransfer`` in ``engines/vllm_worker.py``), a bucket per
``/update_weights``, through vLLM's own NCCL engines on GPUs (``transfer: nccl``, ``engines/nccl.py``), or as a
safetensors file the workers load with ``FileWeightTransfer`` (``transfer: file``, ``/dev/shm`` where there is one);
the exact sync check reads them back through ``AmirWorkerExtension``'s methods on ``/collective_rpc``. The trainer
imports vLLM for this engine only with ``transfer: nccl``.

Every request has a deadline and the server is watched (``helpers/http.py``): a silent or stopped server is named
in a line within a minute, one whose process is gone stops the run at once, SIGTERM ends a blocked request at once,
and each fault is one line naming the server, the route and the key (``ServerError``). The started server's whole
process group ends with the run (``helpers/serving.py``).

With ``push_adapters`` (a LoRA policy) the server serves the policy's adapter (``--enable-lora``, vLLM's
``/v1/load_lora_adapter`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): the base weights are pushed once, then
each sync sends only the LoRA factors, as a new adapter in the old one's place, and reads them back exactly
(``engines/adapters.py``); every request names the adapter. vLLM loads an adapter from a folder: with ``transfer:
gloo`` the server's worker receives the factors over its group and writes that folder on its own machine, so no
folder is shared; with ``file`` or ``nccl`` the trainer writes it in ``transfer_dir``, which the server must see.

Several servers, one model: ``replicas: N`` starts N servers (``devices`` and ``cpu_cores`` split among them),
``url: [http://a:8000, http://b:8000]`` reaches servers you started (``engines/replicas.py``). A rollout's groups go
whole to one replica each, balanced by the tokens they may take; every push reaches every replica, and every
replica is read back and verified at every sync; one that dies, falls silent or holds other weights stops the run
with a line naming it (``the vLLM server (replica 2 of 2) at http://...``).

A server started for a ``url`` must run with the same settings: ``VLLM_SERVER_DEV_MODE=1 AMIR_VLLM_SERVER=1`` in its
environment (and ``VLLM_MAX_STOP_STRINGS`` above 4 where a turn ends at more stop strings) and
``--weight-transfer-config '{"backend": "amir_gloo"}' --worker-extension-cls
amir_lightning.engines.vllm_worker.AmirWorkerExtension --logprobs-mode processed_logprobs`` (``server_command``
returns the whole command), where it reaches the trainer's first process (the group's store listens there); with
``transfer: file``, ``amir_file`` instead, on a machine that shares ``transfer_dir`` with the trainer.
"""

from __future__ import annotations

import atexit
import logging
import math
import shutil
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from amir_lightning.engines import server_setup
from amir_lightning.engines.adapters import ServesAdapters, write_adapter
from amir_lightning.engines.base import (
    Completion,
    RolloutEngine,
    SamplingConfig,
    WeightLayout,
    check_passed_through,
    request_seed,
)
from amir_lightning.engines.digest import ColumnSample, Reading, WeightSlot
from amir_lightning.engines.passthrough import setting_errors
from amir_lightning.engines.replicas import (
    Replica,
    ReplicasClient,
    assign,
    each,
    paused,
    push_over_gloo,
    server_name,
    split_settings,
)
from amir_lightning.engines.server_setup import KEY, ROUTE_S, Planned, adapter_name, write_weights
from amir_lightning.engines.transfer import trainer_address
from amir_lightning.helpers.distributed import from_rank_zero, global_rank, world_size
from amir_lightning.helpers.http import Endpoint, ServerError
from amir_lightning.helpers.serving import REFUSED_S, ServerProcess, free_port, reachable_url
from amir_lightning.helpers.validation import check_number, raise_errors

log = logging.getLogger(__name__)


class VLLMServerEngine(ServesAdapters, RolloutEngine):
    """Generate with a vLLM server in its own process, on its own devices (it can sample while the policy trains).

    Args:
        url: Address of a running server (started as the module docstring says), or a list of them (the replicas of
            one model); ``None``: start the server(s) here.
        replicas: How many servers to start here (each with ``tensor_parallel_size`` workers), every one holding the
            policy's weights; ``None``: one, or as many as ``url`` lists.
        devices: GPUs the started server runs on (``CUDA_VISIBLE_DEVICES``, e.g. ``"6,7"``), away from the
            trainer's; with replicas, cut into equal runs (``"4,5,6,7"``: ``"4,5"`` and ``"6,7"`` for 2) or a list
            of each replica's; ``None``: as the environment says.
        cpu_cores: CPU cores the started server is pinned to (``taskset -c``, e.g. ``"1"``); with replicas, a list
            of each replica's (one string: all of them share those cores); ``None``: all.
        host: The address the started server listens on: ``127.0.0.1`` (this machine only) or ``0.0.0.0`` when
            training processes on other nodes share it. Its RL routes take weight updates from anyone who reaches
            it: keep it on a trusted network.
        threads: Threads of the started server's CPU kernels (``OMP_NUM_THREADS``); ``None``: as the environment.
        dtype: Model dtype in the server (``auto``: ``bfloat16`` on GPU, ``float32`` on CPU).
        max_model_len: Longest prompt + completion, in tokens.
        kv_cache_memory_bytes: KV-cache size (what to set on CPU; 256 MiB there by default).
        gpu_memory_utilization: Share of each of its GPUs the server may take (it trains nothing there).
        tensor_parallel_size: GPUs per server.
        max_num_seqs: Sequences decoded together.
        enable_prefix_caching: Reuse the KV cache of shared prompt prefixes (the G samples of a group).
        transfer_dir: Where pushed weights are written for the server to load (``/dev/shm`` when it exists).
        startup_timeout: Seconds the started server may take to answer.
        request_timeout: Seconds one request may take (a prompt's samples are one request); ``None``: from what it
            asks (2 minutes, plus 2 s for each token a sequence may write, per wave of ``max_num_seqs``
            sequences; 10 minutes for a weight update). A server silent for a minute is said in a line with the
            state of its process, and one whose process is gone stops the run at once.
        log_file: Where the started server's output goes (default: a file beside the pushed weights).
        push_adapters: With a LoRA policy (``model.lora``), push its adapters at each sync, not the merged
            weights (the base weights once, at the first); on one server worker (``tensor_parallel_size`` 1).
        transfer: How a push reaches the server: ``gloo``, a broadcast from the trainer's first process to every
            server worker over a gloo group of their own (``engines/transfer.py``: no file, no folder in common;
            the server's workers need only reach the trainer's first process); ``nccl`` (GPUs), vLLM's own NCCL
            engines, one broadcast from the trainer's GPU to every replica's workers (``engines/nccl.py``: vLLM and
            CUDA in the trainer's first process); ``file``, a safetensors file in ``transfer_dir`` that the server
            must see at the same path. Whichever, the trainer streams the push
            (``models/sharded.py``), never holding the whole model for it, and every push is read back and
            verified.
        server_args: Any other setting of the started server, as its command-line flags (``engines/passthrough.py``:
            ``{max_num_batched_tokens: 8192}`` is ``--max-num-batched-tokens 8192``, ``true`` a bare flag). The
            settings the run owns and ``quantization`` are refused in one line naming the key; for a server given by
            ``url``, its own command line sets them.
    """

    def __init__(
        self,
        url: str | list[str] | None = None,
        devices: str | list[str] | None = None,
        cpu_cores: str | list[str] | None = None,
        host: str = "127.0.0.1",
        threads: int | None = None,
        dtype: str = "auto",
        max_model_len: int = 1024,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        transfer_dir: str | None = None,
        startup_timeout: float = 600.0,
        request_timeout: float | None = None,
        log_file: str | None = None,
        push_adapters: bool = False,
        server_args: dict[str, Any] | None = None,
        transfer: str = "gloo",
        replicas: int | None = None,
    ) -> None:
        # vLLM's names are the server's to check (its start fails naming the flag): the trainer never imports vLLM
        errors: list[str] = setting_errors(server_args or {}, f"{KEY}.server_args", None, server_setup.owned_flags())
        if server_args and url is not None:
            errors.append(f"{KEY}.server_args are flags of a server started here: the server at url has its own")
        check_number(errors, f"{KEY}.max_model_len", max_model_len, ge=1)
        check_number(errors, f"{KEY}.kv_cache_memory_bytes", kv_cache_memory_bytes, gt=0, optional=True)
        check_number(errors, f"{KEY}.gpu_memory_utilization", gpu_memory_utilization, gt=0, le=1)
        check_number(errors, f"{KEY}.tensor_parallel_size", tensor_parallel_size, ge=1)
        check_number(errors, f"{KEY}.max_num_seqs", max_num_seqs, ge=1)
        check_number(errors, f"{KEY}.threads", threads, ge=1, optional=True)
        check_number(errors, f"{KEY}.startup_timeout", startup_timeout, gt=0)
        check_number(errors, f"{KEY}.request_timeout", request_timeout, gt=0, optional=True)
        if url is not None and (devices is not None or cpu_cores is not None):
            errors.append(f"{KEY}: url names a running server; devices and cpu_cores are for one started here")
        if push_adapters and tensor_parallel_size > 1:
            errors.append(f"{KEY}.push_adapters reads the served adapter back from one server worker: set "
                          "tensor_parallel_size 1, or push_adapters false to push merged weights")  # fmt: skip
        urls = [url] if isinstance(url, str) else list(url) if url is not None else None
        check_number(errors, f"{KEY}.replicas", replicas, ge=1, optional=True)
        count = replicas if replicas is not None else len(urls) if urls else 1
        if urls is not None and (not urls or len(set(urls)) != len(urls) or len(urls) != count):
            errors.append(f"{KEY}.url lists {len(urls)} server(s) ({len(set(urls))} distinct) for {count} replica(s): "
                          "list each replica's address once (replicas: N is for servers started here)")  # fmt: skip
        if not isinstance(count, int) or count < 1:
            count = 1
        self.device_sets = split_settings(devices, count, f"{KEY}.devices", errors, split=True)
        self.core_sets = split_settings(cpu_cores, count, f"{KEY}.cpu_cores", errors, split=False)
        if cpu_cores is not None and shutil.which("taskset") is None:
            errors.append(f"{KEY}.cpu_cores needs the taskset command (util-linux), which this machine lacks")
        if transfer not in ("gloo", "nccl", "file"):
            errors.append(f"{KEY}.transfer must be gloo (the weights over the network), nccl (GPU to GPU) or file, "
                          f"got {transfer!r}")  # fmt: skip
        raise_errors(errors)
        self.transfer, self.count = transfer, count
        self.replicas: list[Replica] = []  # known at the start
        self.devices, self.cpu_cores, self.threads = devices, cpu_cores, threads
        self.host, self.server_args = host, dict(server_args or {})
        self.dtype, self.max_model_len, self.kv_cache_memory_bytes = dtype, max_model_len, kv_cache_memory_bytes
        self.gpu_memory_utilization, self.tensor_parallel_size = gpu_memory_utilization, tensor_parallel_size
        self.max_num_seqs, self.enable_prefix_caching = max_num_seqs, enable_prefix_caching
        self.transfer_dir, self.startup_timeout, self.request_timeout = transfer_dir, startup_timeout, request_timeout
        self.log_file, self.given_url = log_file, urls
        self.push_adapters = push_adapters
        self._adapter: str | None = None  # the served adapter that requests name, once pushed
        self._places: dict[str, tuple[str, int] | None] = {}
        self._launched: list[ServerProcess] = []  # the servers this process started
        self.pushes = 0  # the weight version the server holds (0: the files it started from)
        self.updates_in_flight = False  # pushes keep requests in flight (``start``'s, from partial_rollouts)
        self._slots: dict[str, WeightSlot | None] = {}
        self._workdir: Path | None = None

    runs_apart = True
    takes_updates_in_flight = True

    # ------------------------------------------------------------------ the server
    def server_command(self, model_dir: Path, port: int, seed: int, on_gpu: bool, replica: int = 0) -> list[str]:
        """The command line of a server for ``model_dir`` on ``port`` (the environment is ``server_env``'s)."""
        return server_setup.server_command(self, model_dir, port, seed, on_gpu, replica)

    def server_env(self, replica: int = 0) -> dict[str, str]:
        """The started server's environment: the RL routes on, the transfer backend registered in its workers."""
        return server_setup.server_env(self, replica)

    @property
    def url(self) -> str | None:
        """The first server's address (``None`` before the start, unless given)."""
        if self.replicas:
            return self.replicas[0].url
        return self.given_url[0] if self.given_url else None

    @property
    def urls(self) -> list[str]:
        """Every replica's address."""
        return [replica.url for replica in self.replicas]

    @property
    def endpoint(self) -> Endpoint:
        """The first server's endpoint."""
        return self.replicas[0].endpoint

    @property
    def server(self) -> ServerProcess | None:
        """The first server's process, when this process started it."""
        return self.replicas[0].server if self.replicas else None

    @property
    def process(self):
        """The process of the (first) server this process started (``None``: it started none)."""
        return self.server.process if self.server is not None else None

    def start(
        self, model_dir: Path, seed: int, device: torch.device | None = None, local_rank: int = 0, in_flight=False
    ) -> None:
        """Start the server(s) (or reach those at ``url``); with several training processes, the first starts them.

        Every process then sends its own prompts to the replicas, which batch them; the first pushes the weights, and
        every process reads them back from every replica for its sync check.
        """
        del device, local_rank  # the server has devices of its own
        if self.transfer == "nccl" and global_rank() == 0:
            nccl_missing()
        self.updates_in_flight = in_flight
        self._workdir = server_setup.make_workdir(self.transfer_dir)
        # where the first process started them (or the urls given)
        urls = from_rank_zero(lambda: self.given_url or self._launch(model_dir, seed))
        started = self._launched or [None] * len(urls)
        absent = server_setup.ABSENT if self.given_url else "the server the first training process started is gone"
        route_s = self.request_timeout or ROUTE_S
        self.replicas = [
            Replica(
                index,
                len(urls),
                Endpoint(url, server_name(index, len(urls)), f"{KEY}.url", server_setup.EXPECT, absent, started[index]),
                route_s,
                started[index],
            )  # fmt: skip
            for index, url in enumerate(urls)
        ]
        for replica in self.replicas:  # they start side by side
            replica.wait_until_ready(self.startup_timeout, REFUSED_S if self.given_url else None)
        if global_rank() == 0:
            if self.transfer == "gloo":  # joined here to find a server that cannot take it at the start
                each(self.replicas, "join_transfer")
                log.info("weight push: broadcast to %s over gloo (%s.transfer)",
                         ", ".join(f"{r.workers} worker(s) at {r.url}" for r in self.replicas), KEY)  # fmt: skip
            elif self.transfer == "nccl":  # a group is joined at each push: count each replica's workers now
                each(self.replicas, "count_workers")
            else:
                each(self.replicas, "init_file_transfer")
            each(self.replicas, "warm")
        _barrier()
        self._started = True

    def _launch(self, model_dir: Path, seed: int) -> list[str]:
        """Start every replica's server (they start side by side); their addresses."""
        urls = []
        for index in range(self.count):
            port = free_port(self.host)
            command = self.server_command(model_dir, port, seed, torch.cuda.is_available(), index)
            log_path = Path(self.log_file) if self.log_file else self._workdir / "server.log"
            if self.count > 1:
                log_path = log_path.with_name(f"{log_path.stem}.replica{index + 1}{log_path.suffix}")
            url = reachable_url(self.host, port)
            self._launched.append(ServerProcess(command, self.server_env(index), url, log_path,
                                                server_name(index, self.count)))  # fmt: skip
            urls.append(url)
        atexit.register(self.close)  # the pushed weights go with them
        return urls

    # ------------------------------------------------------------------ the engine
    def generate(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig, seed: int | None = None
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt, from ``seed`` (default: drawn from torch's random stream).

        A rollout is then a function of the run's seed and its place in the run (the data module forks and seeds
        torch's RNG around every generation, or passes the seed when it generates in the background). vLLM seeds a
        request's n samples with seed, seed + 1, ...: each prompt's range starts at a hash of the generation's seed and
        its place (``request_seed``), so no two prompts, ranks or rounds share a stream but by chance. Each prompt's
        group goes to one replica (``replicas.assign``).
        """
        base = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        body = {"n": n, **sampling.vllm_params(), "logprobs": 0, "return_token_ids": True} | self._model()
        costs = [len(prompt) + n * int(body.get("max_tokens") or 16) for prompt in prompts]
        chosen = [self.replicas[index] for index in assign(costs, len(self.replicas), global_rank())]
        # Every prompt in flight at once: each server batches its share as it would one request.
        sequences = math.ceil(len(prompts) / len(self.replicas)) * n * world_size()
        deadline = server_setup.deadline(self, "/v1/completions", body, sequences)

        def one(index: int) -> list[Completion]:
            prompt, seeded, replica = list(prompts[index]), request_seed(base, index), chosen[index]
            if self.updates_in_flight:  # the route that says which weights sampled each token
                params = {k: v for k, v in body.items() if k not in ("return_token_ids", "model")} | {"seed": seeded}
                request = {"token_ids": prompt, "sampling_params": params, "output_mode": "text"} | self._model()
                answer = replica.post("/inference/v1/generate", request, deadline)
                return server_setup.generated(replica.endpoint, answer, n)
            answer = replica.post("/v1/completions", body | {"prompt": prompt, "seed": seeded}, deadline)
            return server_setup.completions(replica.endpoint, answer, n)

        with ThreadPoolExecutor(max_workers=min(len(prompts), 256) or 1) as pool:
            return list(pool.map(one, range(len(prompts))))

    @override
    def check_sampling(self, sampling: SamplingConfig) -> None:
        try:  # the fields of the server's completion request, where this process has vLLM to read them from
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        except ImportError:
            return  # the server names an unknown field in its answer to the first request
        check_passed_through(sampling, set(CompletionRequest.model_fields), "the vLLM server's completion request")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Push the weights through vLLM's update routes into every replica, generation paused; the first process
        pushes for all.

        Every process has finished its generation of this step (the rollouts sampling ahead go on, on the new
        weights, with ``updates_in_flight``; otherwise they finished before).
        """  # noqa: D205
        plan = getattr(named_tensors, "plan", None)  # known first (a WeightStream): see below
        if plan is not None:
            # Where the server keeps each tensor, asked by every process before any push begins: the sync check's
            # digests ask it as the stream passes, and asked mid-update (another process pushing) the answers come
            # from layers being reloaded.
            self.slots([item[0] for item in plan])
        _barrier()
        if global_rank() != 0:
            for _ in named_tensors:  # the export is a collective under FSDP2: take part, keep nothing
                pass
            _barrier()  # the first process has pushed: reading back now reads the new weights
            self.pushes += 1
            return
        try:
            if plan is None:  # any iterable of (name, tensor): kept whole to learn its header
                kept = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_tensors]
                named_tensors, plan = kept, [(name, tuple(t.shape), t.dtype) for name, t in kept]
                self.slots([name for name, _ in kept])
            plan = [(p[0], tuple(p[1]), p[2]) for p in plan]
            if not plan:
                raise ValueError("load_weights got no tensors: the engine would keep stale weights")
            if self.transfer == "gloo":
                self._push_gloo(plan, named_tensors, version)
            elif self.transfer == "nccl":
                self._push_nccl(plan, named_tensors, version)
            else:
                self._push_file(plan, named_tensors, version)
        finally:
            _barrier()

    def _model(self) -> dict[str, str]:
        """What a request names to be served by the policy's pushed adapter (nothing before the first push)."""
        return {"model": self._adapter} if self._adapter is not None else {}

    @override
    def load_adapters(self, adapters: dict[str, torch.Tensor], rank: int) -> None:
        """Serve ``adapters`` as every replica's adapter from now on; the first process pushes for all."""
        _barrier()
        try:
            if global_rank() == 0:
                try:
                    self._push_adapter(adapters, rank, self._served_dtype())
                except ServerError as err:
                    if "/v1/load_lora_adapter" not in str(err) or "404" in str(err):
                        raise
                    raise ServerError(f"{err}; set {KEY}.push_adapters false to push merged weights",
                                      tail=err.tail) from None  # fmt: skip
            else:
                self.pushes += 1
        finally:
            _barrier()
        self._adapter = adapter_name(self.pushes)  # every process counts the pushes
        for replica in self.replicas:
            replica.serve(self._adapter)

    # ------------------------------------------------------------------ the routes a push goes through
    def _targets(self) -> list[Replica]:
        """The replicas a push goes to: every one."""
        return self.replicas

    def _push_file(self, plan: list[Planned], named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push ``named`` into every replica: a file in the transfer folder, loaded through vLLM's update routes.

        The file is written once, a tensor at a time (``write_weights``, its header from ``plan``). Then on every
        replica at once: ``/pause``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` with the
        run's weight ``version`` (the optimisation step), ``/reset_prefix_cache``, ``/resume`` (``replicas.paused``).
        """
        path = self._workdir / f"push_{self.pushes + 1}.safetensors"
        write_weights(path, plan, named)
        targets = self._targets()
        try:
            with paused(targets, self.updates_in_flight):
                each(targets, "start_update")
                each(targets, "load_file", path)
                each(targets, "finish_update", version)
        finally:
            path.unlink(missing_ok=True)
        self.pushes += 1

    def _push_gloo(self, plan: list[Planned], named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push ``named`` into every replica over one gloo group of this process and their workers, generation paused.

        A bucket at a time (``replicas.push_over_gloo``): the routes vLLM's NCCL trainer engine drives, through the
        same client.
        """
        targets = self._targets()
        with paused(targets, self.updates_in_flight):
            push_over_gloo(targets, plan, named, version)
        self.pushes += 1

    def _push_nccl(self, plan: list[Planned], named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push ``named`` into every replica through vLLM's NCCL engines (``engines/nccl.py``), generation paused.

        vLLM's trainer engine drives the routes (``/init_weight_transfer_engine`` for a group of this process's GPU
        and every replica's workers, ``/start_weight_update``, ``/update_weights`` while it broadcasts,
        ``/finish_weight_update`` with the weight ``version``) through ``replicas.ReplicasClient``, which sends each
        to every replica.
        """
        from amir_lightning.engines import nccl

        targets = self._targets()
        each(targets, "count_workers")
        address = trainer_address(targets[0].url)
        device = torch.device("cuda", torch.cuda.current_device())
        with paused(targets, self.updates_in_flight):
            nccl.push(plan, named, ReplicasClient(targets, version), address, free_port(address), device)
        self.pushes += 1

    def _push_adapter(self, adapters: dict[str, torch.Tensor], rank: int, dtype: torch.dtype) -> None:
        """Serve ``adapters`` from every replica as a new LoRA adapter (``adapter_name``), and drop the last one.

        vLLM's ``/v1/load_lora_adapter``, generation paused as for a weight push. Each push is an adapter of its own
        (``policy-<push>``): one loaded ``load_inplace`` would be read from its folder again at every scheduling step,
        as vLLM 0.32 re-applies such a request's adapter. A server holds one adapter (``--max-loras 1``), so the new one
        takes the old one's place. The route reads a folder: with ``transfer: gloo`` each replica's worker receives
        the factors over its group and writes that folder on its own machine (``Replica.send_adapter``); otherwise
        the folder is written here once, in ``transfer_dir``, for every replica to read.
        """
        name = adapter_name(self.pushes + 1)
        targets = self._targets()
        if self._adapter is None:  # this run's first: an earlier run on a server given by url left its adapter
            each(targets, "unload_left")
        if self.transfer == "gloo":
            each(targets, "join_transfer")
            with paused(targets, self.updates_in_flight):
                each(targets, "send_adapter", name, adapters, rank)
                each(targets, "load_received", name)
        else:
            folder = self._workdir / name
            try:
                write_adapter(folder, adapters, rank, dtype)
            except OSError as err:
                shutil.rmtree(folder, ignore_errors=True)
                raise ServerError(f"could not write the pushed adapters to {folder} ({KEY}.transfer_dir): "
                                  f"{err.strerror or err}") from None  # fmt: skip
            try:
                with paused(targets, self.updates_in_flight):
                    each(targets, "load_adapter", name, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # read into the servers' memory by now
        if self._adapter is not None:  # the last adapter, no longer served
            each(targets, "unload", self._adapter)
        self.pushes += 1

    # ------------------------------------------------------------------ the read-back
    @override
    def copies(self) -> list[tuple[str, Replica]]:
        """Every replica, named (``replica 2 of 2 at http://...``) where there are several."""
        return [(replica.label, replica) for replica in self.replicas]

    @override
    def held_adapters(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The LoRA factors the first replica serves (the sync check reads every replica: ``copies``)."""
        return self.replicas[0].held_adapters()

    def adapter_places(self, modules: list[str]) -> dict[str, tuple[str, int] | None]:
        """The server's LoRA layer and slice for each of the trainer's adapted layers (asked once per layer).

        The first replica answers for all: they serve one model with one configuration.
        """
        missing = [m for m in modules if m not in self._places]
        if missing:
            self._places.update(self.replicas[0].adapter_places(missing))
        return {m: self._places[m] for m in modules}

    def _served_dtype(self) -> torch.dtype:
        """The dtype the server computes in (its adapter is written in it)."""
        name = server_setup.served_dtype(self, torch.cuda.is_available())
        return getattr(torch, {"half": "float16", "float": "float32"}.get(name, name))

    @override
    def weight_layout(self) -> WeightLayout:
        return _ServerLayout(self)

    def slots(self, names: list[str]) -> dict[str, WeightSlot | None]:
        """Where the server keeps each of ``names`` (asked once per name: the layout does not change).

        The first replica answers for all: each is read back against it, so one that keeps a tensor elsewhere is
        found wrong.
        """
        missing = [n for n in names if n not in self._slots]
        if missing:
            self._slots.update(self.replicas[0].slots(missing))
        return {n: self._slots[n] for n in names}

    @override
    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]]:
        """What the first replica holds (the sync check reads every replica: ``copies``)."""
        return self.replicas[0].held_weights(columns)

    @override
    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """The log-probs of ``completion`` after ``prompt`` under the first replica's weights."""
        return self.replicas[0].score(prompt, completion)

    def close(self) -> None:
        """Stop the servers this process started (a server at a given ``url`` keeps running)."""
        for server in self._launched:
            server.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __del__(self) -> None:
        if sys.is_finalizing():  # the interpreter's own names are gone; the servers' watchers stop them as we exit
            return
        if getattr(self, "_launched", None):
            self.close()


def nccl_missing() -> None:
    """Stop with one line where ``transfer: nccl`` cannot run: no CUDA, or no vLLM in the trainer's first process."""
    if not torch.cuda.is_available():
        raise ValueError(f"{KEY}.transfer nccl sends from the trainer's GPU, and this process has no CUDA device: set "
                         "transfer gloo (the same stream over the network)")  # fmt: skip
    try:
        import vllm.distributed.weight_transfer.nccl_engine  # noqa: F401
    except ImportError as err:
        raise ValueError(f"{KEY}.transfer nccl runs vLLM's trainer-side NCCL engine, which this process cannot import "
                         f"({err}): install the gpu extra, or set transfer gloo") from None  # fmt: skip


def _barrier() -> None:
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier()


class _ServerLayout(WeightLayout):
    """The server's ``WeightSlot`` of each pushed name, asked of its workers."""

    def __init__(self, engine: VLLMServerEngine) -> None:
        self.engine = engine

    @override
    def slot(self, name: str) -> WeightSlot | None:
        return self.engine.slots([name])[name]

    @override
    def adapter_place(self, module: str) -> tuple[str, int] | None:
        return self.engine.adapter_places([module])[module]
