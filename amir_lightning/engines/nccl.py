"""``VLLMServerEngine``'s ``nccl`` transfer (GPUs): vLLM's own NCCL engines carry a push, on both sides.

The trainer side is vLLM's ``NCCLTrainerWeightTransferEngine``, built by its factory
(``WeightTransferTrainerFactory.trainer_init``); the server's workers run vLLM's ``NCCLWeightTransferEngine``
(``--weight-transfer-config '{"backend": "nccl"}'``). What the run adds:

- ``PlannedSource``, the ``WeightSource`` vLLM's engine sends from: the push's plan (names, shapes, dtypes, known
  before the first gather) as its ``metadata()``, and the push's stream (buckets gathered from the FSDP2 shards as
  they come, digested for the exact check as they pass) as its one pass. vLLM checks each tensor against the plan as
  it sends (``_checked_iter``).
- ``replicas.ReplicasClient``, the ``VLLMWeightSyncClient`` it drives (the gloo push drives the same one): every
  route goes to every replica at once, over the run's requests (deadlines, a dead or silent server named in one line,
  ``helpers/http.py``). All replicas' workers are one NCCL group, each replica's ranks after the last one's, so one
  broadcast from the GPU reaches every replica: the bytes never touch host memory and there is no file.

Every push is read back exactly from every replica afterwards, as with any transfer (``loop/sync.py``).
This module imports vLLM: it is imported only by a push with ``transfer: nccl``, which needs vLLM (the ``gpu`` extra)
and CUDA in the trainer's first process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from amir_lightning.engines.server_setup import Planned

if TYPE_CHECKING:
    from amir_lightning.engines.replicas import ReplicasClient


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
