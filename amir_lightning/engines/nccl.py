"""``VLLMServerEngine``'s ``nccl`` transfer (GPUs): vLLM's own NCCL engines carry a push, on both sides.

The trainer side is vLLM's ``NCCLTrainerWeightTransferEngine``, built by its factory
(``WeightTransferTrainerFactory.trainer_init``); the server's workers run vLLM's ``NCCLWeightTransferEngine``
(``--weight-transfer-config '{"backend": "nccl"}'``). What the run adds:

- ``PlannedSource``, the ``WeightSource`` vLLM's engine sends from: the push's plan (names, shapes, dtypes, known
  before the first gather) as its ``metadata()``, and the push's stream (buckets gathered from the FSDP2 shards as
  they come, digested for the exact check as they pass) as its one pass. vLLM checks each tensor against the plan as
  it sends (``_checked_iter``).
- ``ReplicasClient``, the ``VLLMWeightSyncClient`` it drives: every route goes to every replica at once, over the
  run's requests (deadlines, a dead or silent server named in one line, ``helpers/http.py``). All replicas' workers
  are one NCCL group, each replica's ranks after the last one's, so one broadcast from the GPU reaches every replica:
  the bytes never touch host memory and there is no file.

Every push is read back exactly from every replica afterwards, as with any transfer (``loop/sync.py``).
This module imports vLLM: it is imported only by a push with ``transfer: nccl``, which needs vLLM (the ``gpu`` extra)
and CUDA in the trainer's first process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from amir_lightning.engines.server_setup import KEY, Planned
from amir_lightning.helpers.http import Endpoint, request


class PlannedSource(WeightSource):
    """One push as vLLM's engines read it: the plan first, then the stream, once.

    Args:
        plan: Each tensor's name, shape and dtype, in the stream's order.
        named: The stream of ``(name, tensor)``; each tensor is sent from ``device``.
        device: Where NCCL sends from (the trainer's GPU).
    """

    def __init__(self, plan: list[Planned], named: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
        self.plan, self.named, self.device = plan, named, device
        self._read = False

    def metadata(self) -> list[ParamMeta]:
        """The plan, as vLLM declares a push to its workers."""
        return [ParamMeta(name, dtype, tuple(shape)) for name, shape, dtype in self.plan]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream's one pass (a second would read an exhausted stream: an error, not an empty push)."""
        if self._read:
            raise RuntimeError("a push's stream is read once: a new push needs a new PlannedSource")
        self._read = True
        for name, tensor in self.named:
            yield name, tensor.detach().to(self.device, non_blocking=False)


class ReplicasClient:
    """vLLM's ``VLLMWeightSyncClient`` over every replica of one engine: each route to all of them at once.

    Args:
        endpoints: Each replica's server.
        workers: Each replica's workers (its ranks in the NCCL group follow the ones before it).
        deadline_s: Each route's deadline (``request_timeout``, else 10 minutes).
        version: The weight version ``/finish_weight_update`` labels the push with.
    """

    def __init__(self, endpoints: list[Endpoint], workers: list[int], deadline_s: float, version: int) -> None:
        self.endpoints, self.workers, self.deadline_s, self.version = endpoints, workers, deadline_s, version

    def _post_all(self, route: str, bodies: list[dict | None]) -> None:
        def post(index: int) -> dict:
            return request(self.endpoints[index], route, bodies[index], deadline_s=self.deadline_s,
                           deadline_key=f"{KEY}.request_timeout")  # fmt: skip

        with ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="amir-nccl-route") as pool:
            futures = [pool.submit(post, index) for index in range(len(self.endpoints))]
        for future in futures:  # the first error, in the replicas' order
            future.result()

    def offsets(self) -> list[int]:
        """Each replica's first rank in the group (the trainer is rank 0)."""
        return [1 + sum(self.workers[:index]) for index in range(len(self.workers))]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Have every replica's workers join the group, each replica at its own ranks."""
        bodies = [{"init_info": init_info | {"rank_offset": offset}} for offset in self.offsets()]
        self._post_all("/init_weight_transfer_engine", bodies)

    def start_weight_update(self) -> None:  # noqa: D102
        self._post_all("/start_weight_update", [None] * len(self.endpoints))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Every replica receives the broadcast (the route returns once its workers have loaded it)."""
        self._post_all("/update_weights", [{"update_info": update_info}] * len(self.endpoints))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update, labelled with the push's weight version."""
        body = {"weight_version": weight_version or str(self.version)}
        self._post_all("/finish_weight_update", [body] * len(self.endpoints))


def init_info(address: str, port: int, workers: list[int]) -> NCCLTrainerInitInfo:
    """The trainer's init info: its store at ``address:port``, a group of the trainer and every replica's workers."""
    return NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + sum(workers), rank=0)


def push(
    plan: list[Planned],
    named: Iterable[tuple[str, torch.Tensor]],
    client: ReplicasClient,
    address: str,
    port: int,
    device: torch.device,
) -> None:
    """One push through vLLM's NCCL engines: the group joined, the plan sent, the stream broadcast, the group closed.

    A group for each push, as for the gloo transfer: a server keeps the last group a trainer brought.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    source = PlannedSource(plan, named, device)
    engine = WeightTransferTrainerFactory.trainer_init(init_info(address, port, client.workers), client=client,
                                                       source=source)  # fmt: skip
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
