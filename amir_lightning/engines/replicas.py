"""The vLLM servers one ``VLLMServerEngine`` generates from: each a ``Replica``, every one holding the same weights.

A replica is one server and the routes the engine sends it: generation, the weight push, the adapter push, and the
read-back the sync check compares. ``VLLMServerEngine`` keeps a list of them: a rollout's groups are spread over them,
whole (a prompt's samples share its prefix cache on one server), balanced by the tokens they may take (``assign``);
every push reaches every one, through one client that sends each route to all of them at once (``ReplicasClient``,
over one group of the trainer and every replica's workers: ``push_over_gloo``, or vLLM's NCCL engine,
``engines/nccl.py``); and the sync check reads each one back (``RolloutEngine.copies``). Each is a server of its
own for the fault machinery (``helpers/http.py``): one that dies, falls silent or holds other weights stops the run
with a line naming it (``the vLLM server (replica 2 of 2) at http://...``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from amir_lightning.engines import server_setup
from amir_lightning.engines.digest import ColumnSample, Reading, WeightSlot
from amir_lightning.engines.server_setup import ADAPTER, KEY, ROUTE_S, UNREAD
from amir_lightning.engines.shards import merge_workers
from amir_lightning.engines.transfer import GlooInit, gloo_group, send_into, trainer_address, update_info
from amir_lightning.engines.vllm_worker import decode
from amir_lightning.helpers.http import Endpoint, ServerError, reading, request
from amir_lightning.helpers.serving import ServerProcess, free_port, wait_for
from amir_lightning.models import sharded

log = logging.getLogger(__name__)


def server_name(index: int, count: int) -> str:
    """A replica's name in messages: ``the vLLM server``, or ``the vLLM server (replica 2 of 3)``."""
    return "the vLLM server" if count == 1 else f"the vLLM server (replica {index + 1} of {count})"


@dataclasses.dataclass
class Replica:
    """One vLLM server of the engine, and the routes the engine sends it.

    Attributes:
        index: Its place among the engine's replicas (0 first).
        count: How many replicas the engine has.
        endpoint: Where its requests go and how its faults are named.
        route_s: The deadline of a route other than generation (``request_timeout``, else ``ROUTE_S``).
        server: Its process, when this run started it.
        workers: Its workers (``tensor_parallel_size`` of them), counted at its first gloo push.
        group: The trainer's end of a gloo group with this server alone (``join_transfer``: the start's check that
            it takes the gloo transfer, and each adapter push).
        adapter: The name of the adapter its requests name (a pushed LoRA adapter), else ``None``.
        received: The folder on the server's machine its worker wrote the adapter pushed last into, until loaded.
    """

    index: int
    count: int
    endpoint: Endpoint
    route_s: float = ROUTE_S
    server: ServerProcess | None = None
    workers: int | None = None
    group: Any = None
    adapter: str | None = None
    received: str | None = None

    @property
    def url(self) -> str:
        """Its address."""
        return self.endpoint.url

    @property
    def label(self) -> str:
        """How the sync check names it (empty for an engine of one server)."""
        return f"replica {self.index + 1} of {self.count} at {self.url}" if self.count > 1 else ""

    def post(self, route: str, body: dict | None = None, deadline_s: float | None = None, plain: bool = False) -> dict:
        """``body`` to ``route``, within ``deadline_s`` (by default ``route_s``)."""
        return request(self.endpoint, route, body, deadline_s=deadline_s or self.route_s,
                       deadline_key=f"{KEY}.request_timeout", plain=plain)  # fmt: skip

    def wait_until_ready(self, timeout: float, refused_s: float | None) -> None:
        """Return once it answers ``/health`` (its process watched, when this run started it)."""
        key = f"{KEY}.startup_timeout"
        if self.server is not None:
            return self.server.wait_until_ready(timeout, key)
        wait_for(self.endpoint, timeout, key, refused_s=refused_s)

    # ------------------------------------------------------------------ the start
    def warm(self) -> None:
        """The first request, seconds slower; its answer shows the server sends what generate reads."""
        warm = {"prompt": [0], "max_tokens": 1, "logprobs": 0, "return_token_ids": True}
        try:
            server_setup.completions(self.endpoint, self.post("/v1/completions", warm), 1)
        except ServerError as err:
            if "Out of range float" not in str(err):
                raise
            # a log-prob it cannot write as JSON: NaN or infinite weights, before this run pushed any
            raise ServerError(f"{err}: the server's weights give non-finite log-probs (a push an earlier run "
                              "left half done?); restart the server", err.tail) from None  # fmt: skip

    def init_file_transfer(self) -> None:
        """Ready the ``amir_file`` transfer in its workers."""
        self.post("/init_weight_transfer_engine", {"init_info": {}})

    def count_workers(self) -> int:
        """Its workers (asked once: one answer of ``/collective_rpc`` per worker)."""
        if self.workers is None:
            answers = self.post("/collective_rpc", {"method": "amir_worker_rank"})
            with reading(self.endpoint, "/collective_rpc", answers) as answer:
                self.workers = len(answer["results"])
        return self.workers

    def join_transfer(self) -> None:
        """The trainer's end of an ``amir_gloo`` group with every worker of this server alone.

        The store listens here; ``/init_weight_transfer_engine`` has each worker join, while this process joins as
        rank 0 in a thread of its own (the route's error, if it fails, is the one raised). Used at the start (a
        server that cannot take the gloo transfer is found there) and for an adapter push; a weight push joins one
        group of every replica's workers (``push_over_gloo``).
        """
        self.count_workers()
        address = trainer_address(self.url)
        port = free_port(address)
        info = GlooInit(address, port, 1, 1 + self.workers, ROUTE_S)
        joined: dict[str, object] = {}
        thread = threading.Thread(target=_join, args=(info, joined), name="amir-transfer-join", daemon=True)
        thread.start()
        try:
            self.post("/init_weight_transfer_engine", {"init_info": dataclasses.asdict(info)})
        except ServerError as err:  # a server started for the file transfer (amir_file) refuses the gloo one's info
            hint = f"a server started with another weight transfer than amir_gloo needs {KEY}.transfer set to its own"
            raise ServerError(f"{err}; {hint} (file for amir_file)", tail=err.tail) from None
        thread.join(ROUTE_S)
        if "group" not in joined:
            raise ServerError(f"{self.endpoint.what} at {self.url} took /init_weight_transfer_engine but its "
                              f"{self.workers} worker(s) did not join the trainer's gloo group at {address}:{port} "
                              f"({joined.get('error', 'no answer')}); {KEY}.transfer: file pushes through a "
                              "folder instead")  # fmt: skip
        log.debug("weight push: gloo group with the %d worker(s) of %s at %s:%d", self.workers, self.url, address, port)
        self.group = joined["group"]

    # ------------------------------------------------------------------ a push
    def pause(self, keep: bool) -> None:
        """``/pause``: the requests in flight finish first (``wait``), or are kept to go on (``keep``)."""
        self.post("/pause?mode=keep" if keep else "/pause?mode=wait")

    def reset(self, keep: bool) -> None:
        """Drop the prefix cache of the old weights (with ``keep``, the requests in flight go back to the queue)."""
        answer = self.post("/reset_prefix_cache?reset_running_requests=true" if keep else "/reset_prefix_cache")
        if keep and not (isinstance(answer, dict) and answer.get("success")):
            raise ServerError(
                f"{self.endpoint.what} at {self.url} could not drop its cache of the old weights after a push "
                f"with requests in flight (/reset_prefix_cache answered {answer!r:.200})"
            )

    def resume(self) -> None:
        """``/resume``."""
        self.post("/resume")

    def start_update(self) -> None:
        """``/start_weight_update``."""
        self.post("/start_weight_update")

    def finish_update(self, version: int) -> None:
        """``/finish_weight_update``, labelling what it holds with the weight ``version``."""
        self.post("/finish_weight_update", {"weight_version": str(version)})

    def load_file(self, path: Path) -> None:
        """One ``/update_weights`` that has its workers load the safetensors file at ``path``."""
        try:
            self.post("/update_weights", {"update_info": {"path": str(path)}})
        except ServerError as err:
            if any(sign in str(err) for sign in UNREAD):  # the server does not see the trainer's folder
                raise ServerError(f"{err}; it could not read the pushed weights {path}: the server must see "
                                  f"{KEY}.transfer_dir at the same path (the same machine, or a shared file system)",
                                  tail=err.tail) from None  # fmt: skip
            raise

    # ------------------------------------------------------------------ adapters
    def unload_left(self) -> None:
        """Drop the policy adapters it holds from an earlier run.

        ``/v1/models`` lists each with its base as ``parent``.
        """
        answer = request(self.endpoint, "/v1/models", None, deadline_s=self.route_s,
                         deadline_key=f"{KEY}.request_timeout", method="GET")  # fmt: skip
        with reading(self.endpoint, "/v1/models", answer):
            names = [model["id"] for model in answer["data"] if model.get("parent")]
        for left in [name for name in names if name.startswith(f"{ADAPTER}-")]:
            self.unload(left)

    def send_adapter(self, name: str, adapters: dict[str, torch.Tensor], rank: int) -> None:
        """Broadcast an adapter's factors to its worker, which writes them as a folder on its own machine.

        ``AmirWorkerExtension.amir_receive_adapter`` writes it: no folder in common with the trainer.
        """
        tensors = list(adapters.items())
        body = {"method": "amir_receive_adapter", "args": [json.dumps(adapter_spec(name, tensors, rank))]}
        where = f"{self.endpoint.what} at {self.url}"
        answer = broadcast_during(self.group, tensors, where, "/collective_rpc", self.post, "/collective_rpc", body)
        with reading(self.endpoint, "/collective_rpc", answer):
            self.received = str(answer["results"][0])

    def load_received(self, name: str) -> None:
        """Serve the adapter ``send_adapter`` sent as ``name``, then delete its folder on the server."""
        folder, self.received = self.received, None
        try:
            self.load_adapter(name, Path(folder))
        finally:
            with contextlib.suppress(ServerError):  # a folder left in the server's temporary folder is not the run's
                self.post("/collective_rpc", {"method": "amir_remove_adapter", "args": [folder]})

    def load_adapter(self, name: str, folder: Path) -> None:
        """Serve the adapter in ``folder`` as ``name`` (``/v1/load_lora_adapter``)."""
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, plain=True)

    def unload(self, name: str) -> None:
        """Stop serving the adapter ``name``; a failure is not the run's (the next push takes its place)."""
        with contextlib.suppress(ServerError):
            self.post("/v1/unload_lora_adapter", {"lora_name": name}, plain=True)

    def serve(self, adapter: str | None) -> None:
        """Name ``adapter`` in its requests from now on (every process, after each adapter push)."""
        self.adapter = adapter

    # ------------------------------------------------------------------ the read-back
    def slots(self, names: list[str]) -> dict[str, WeightSlot | None]:
        """Where its workers keep each of ``names``."""
        answer = self.post("/collective_rpc", {"method": "amir_weight_slots", "args": [json.dumps(names)]})
        with reading(self.endpoint, "/collective_rpc", answer):
            return decode(answer["results"][0])

    def adapter_places(self, modules: list[str]) -> dict[str, tuple[str, int] | None]:
        """Its LoRA layer and slice for each of the trainer's adapted layers ``modules``."""
        answer = self.post("/collective_rpc", {"method": "amir_adapter_places", "args": [json.dumps(modules)]})
        with reading(self.endpoint, "/collective_rpc", answer):
            return decode(answer["results"][0])

    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]]:
        """What its workers hold of the sampled columns."""
        body = {"method": "amir_held_weights", "args": [json.dumps([columns.seed, columns.count])]}
        answer = self.post("/collective_rpc", body)
        with reading(self.endpoint, "/collective_rpc", answer):
            return merge_workers([decode(result) for result in answer["results"]])

    def held_adapters(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The LoRA factors it serves."""
        answer = self.post("/collective_rpc", {"method": "amir_held_adapters"})
        with reading(self.endpoint, "/collective_rpc", answer):
            return decode(answer["results"][0])

    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """The log-probs of ``completion`` after ``prompt`` under its weights (and its adapter)."""
        ids = list(prompt) + list(completion)
        body = {"prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        if self.adapter is not None:
            body["model"] = self.adapter
        try:
            answer = self.post("/v1/completions", body)
        except ServerError as err:
            if "Out of range float" not in str(err):
                raise
            return [float("nan")] * len(completion)  # the server cannot write an infinite log-prob: not finite
        with reading(self.endpoint, "/v1/completions", answer):
            entries = answer["choices"][0]["prompt_logprobs"][len(prompt) :]
            return [float(entry[str(token)]["logprob"]) for token, entry in zip(completion, entries, strict=True)]


class ReplicasClient:
    """vLLM's ``VLLMWeightSyncClient`` over replicas: each weight-sync route sent to every one of them at once.

    The trainer side of a push drives it, whichever the transport: the gloo push (``push_over_gloo``) and vLLM's own
    NCCL trainer engine (``engines/nccl.py``). All the replicas' workers are one group with the trainer (rank 0):
    each replica's workers take the ranks after the last replica's (``offsets``), so one broadcast reaches them all.

    Args:
        replicas: The replicas a push goes to, their workers counted (``Replica.count_workers``).
        version: The weight version ``/finish_weight_update`` labels the push with.
    """

    def __init__(self, replicas: Sequence[Replica], version: int) -> None:
        self.replicas, self.version = list(replicas), version

    @property
    def workers(self) -> list[int]:
        """Each replica's workers."""
        return [replica.workers for replica in self.replicas]

    def offsets(self) -> list[int]:
        """Each replica's first rank in the group (the trainer is rank 0)."""
        return [1 + sum(self.workers[:index]) for index in range(len(self.replicas))]

    def _post_all(self, route: str, bodies: list[dict | None]) -> None:
        """``bodies[i]`` to ``route`` of replica ``i``, all at once; the first error, in the replicas' order."""
        with ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="amir-replica") as pool:
            futures = [pool.submit(r.post, route, body) for r, body in zip(self.replicas, bodies, strict=True)]
        for future in futures:
            future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Have every replica's workers join the group, each replica at its own ranks."""
        self._post_all("/init_weight_transfer_engine",
                       [{"init_info": init_info | {"rank_offset": offset}} for offset in self.offsets()])  # fmt: skip

    def start_weight_update(self) -> None:
        """``/start_weight_update`` on every replica."""
        self._post_all("/start_weight_update", [None] * len(self.replicas))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Every replica receives the broadcast (the route returns once its workers have loaded it)."""
        self._post_all("/update_weights", [{"update_info": update_info}] * len(self.replicas))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update on every replica, labelled with the push's weight version."""
        body = {"weight_version": weight_version or str(self.version)}
        self._post_all("/finish_weight_update", [body] * len(self.replicas))


def push_over_gloo(
    replicas: Sequence[Replica], plan: list, named: Iterable[tuple[str, torch.Tensor]], version: int
) -> None:
    """One push over the ``amir_gloo`` transfer: one group of the trainer and every replica's workers.

    A bucket at a time, ``/update_weights`` on every replica while this process broadcasts the bucket's bytes once:
    the sequence vLLM's NCCL trainer engine drives (``NCCLTrainerWeightTransferEngine.send_weights``), through the
    same client: ``/init_weight_transfer_engine`` (each replica at its ranks), ``/start_weight_update``, the
    buckets, ``/finish_weight_update`` with the weight ``version``. A group of its own for each push: a server keeps
    the last group a trainer brought (another run that reached it since, or a restart, would leave an older one
    broadcasting to nobody). The stream is read once, one bucket held, whatever the replicas.
    """
    each(replicas, "count_workers")
    client = ReplicasClient(replicas, version)
    address = trainer_address(replicas[0].url)
    info = GlooInit(address, free_port(address), 1, 1 + sum(client.workers), ROUTE_S)
    joined: dict[str, object] = {}
    thread = threading.Thread(target=_join, args=(info, joined), name="amir-transfer-join", daemon=True)
    thread.start()
    client.init_weight_transfer_engine(dataclasses.asdict(info))
    thread.join(ROUTE_S)
    where = ", ".join(r.url for r in replicas)
    if "group" not in joined:
        raise ServerError(f"the vLLM server(s) at {where} took /init_weight_transfer_engine but their "
                          f"{sum(client.workers)} worker(s) did not join the trainer's gloo group at "
                          f"{address}:{info.master_port} ({joined.get('error', 'no answer')}); {KEY}.transfer: file "
                          "pushes through a folder instead")  # fmt: skip
    group, stream = joined["group"], iter(named)
    client.start_weight_update()
    for bucket in sharded.buckets_of(plan, sharded.BUCKET_BYTES):
        tensors = [next(stream) for _ in bucket]
        broadcast_during(group, tensors, f"the vLLM server(s) at {where}", "/update_weights", client.update_weights,
                         update_info(tensors))  # fmt: skip
        del tensors
    client.finish_weight_update()


def broadcast_during(group, tensors: list[tuple[str, torch.Tensor]], where: str, route: str, call, *args):
    """``call(*args)``, a request to ``route`` of the servers ``where`` names, while a thread broadcasts ``tensors``.

    The broadcast goes into ``group``; the call's answer is returned. One that fails or does not end is one line.
    """
    sending: dict[str, object] = {}
    thread = threading.Thread(target=send_into, args=(group, tensors, sending), daemon=True)
    thread.start()
    answer = call(*args)
    thread.join(ROUTE_S)
    if "error" in sending or thread.is_alive():
        raise ServerError(f"{where} answered {route} but the broadcast of its tensors did not end "
                          f"({sending.get('error', 'no end')})")  # fmt: skip
    return answer


def adapter_spec(name: str, tensors: list[tuple[str, torch.Tensor]], rank: int) -> dict:
    """What a worker is told of an adapter broadcast to it.

    Its name, rank, ``lora_alpha`` (the rank: the factors are pre-scaled) and each factor's name, dtype and shape.
    """
    return {"name": name, "rank": rank, "alpha": rank, "update": update_info(tensors)}


def _join(info: GlooInit, joined: dict[str, object]) -> None:
    """The trainer joins a replica's gloo group as rank 0 (in a thread, while the route has the workers join)."""
    try:
        joined["group"] = gloo_group(info.master_address, info.master_port, 0, info.world_size, ROUTE_S)
    except Exception as err:  # noqa: BLE001  named by join_transfer, with the route's answer
        joined["error"] = err


def each(replicas: Sequence[Replica], method: str, *args) -> list:
    """``Replica.<method>(*args)`` on every one of ``replicas`` at once.

    A route blocks until that server's workers answer; the first error, in the replicas' order, is raised once every
    call has ended.
    """
    if len(replicas) == 1:
        return [getattr(replicas[0], method)(*args)]
    with ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="amir-replica") as pool:
        futures = [pool.submit(getattr(replica, method), *args) for replica in replicas]
    return [future.result() for future in futures]


@contextlib.contextmanager
def paused(replicas: Sequence[Replica], keep: bool) -> Iterator[None]:
    """``replicas`` with generation paused, for a push; their prefix caches dropped before they resume.

    ``/pause`` waits for the requests in flight to finish on the old weights; with ``keep`` (updates in flight) it
    keeps them and the cache reset sends them back to the queue: their tokens so far are read again under the new
    weights, which sample the rest.
    """
    try:
        each(replicas, "pause", keep)
        yield
        each(replicas, "reset", keep)
    except BaseException:
        for replica in replicas:
            with contextlib.suppress(ServerError):  # the first failure is the one to name
                replica.resume()
        raise
    each(replicas, "resume")


def assign(costs: Sequence[int], replicas: int, rank: int = 0) -> list[int]:
    """The replica each group goes to: the costliest first, each to the replica with the fewest tokens so far.

    ``costs``: each group's tokens (its prompt, and what its samples may write). Ties go to the replica after the
    last one ``rank`` - 1 would pick first, so processes that each send few groups still spread over the replicas.
    The answer depends only on the costs, the count and the rank: a rerun sends each group where it went before.
    """
    if replicas == 1:
        return [0] * len(costs)
    loads = [(0, (index - rank) % replicas, index) for index in range(replicas)]
    heapq.heapify(loads)
    chosen = [0] * len(costs)
    for group in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        load, order, index = heapq.heappop(loads)
        chosen[group] = index
        heapq.heappush(loads, (load + costs[group], order, index))
    return chosen


def split_settings(value: str | list[str] | None, count: int, key: str, errors: list[str], split: bool) -> list:
    """One setting per replica from ``value``.

    A list names each replica's; a string is every replica's, or with ``split`` (GPUs: ``"0,1,2,3"``) is cut into
    ``count`` equal runs of its comma-separated items.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            errors.append(f"{key} lists {len(value)} settings for {count} replica(s): give one per replica")
            return [None] * count
        return [str(v) for v in value]
    if value is None or count == 1 or not split:
        return [value] * count
    items = [item.strip() for item in str(value).split(",") if item.strip()]
    if len(items) % count:
        errors.append(f"{key} {value!r} has {len(items)} devices for {count} replicas: give a multiple of the "
                      "replicas, or a list of each replica's")  # fmt: skip
        return [None] * count
    size = len(items) // count
    return [",".join(items[i * size : (i + 1) * size]) for i in range(count)]
