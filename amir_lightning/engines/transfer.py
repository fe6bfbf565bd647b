"""The push over a network: the trainer's first process and every worker of a vLLM server in one gloo group.

Both sides of the ``amir_gloo`` weight transfer (``engines/vllm_worker.py`` registers its engine side with vLLM's
``WeightTransferEngineFactory``; ``engines/server.py`` drives it through vLLM's RL routes) use this module, which
needs torch alone: the trainer never imports vLLM for a server. The group is a gloo ``ProcessGroup`` of its own (a
``TCPStore`` the trainer serves, a prefix per push group), apart from either side's default process group, as vLLM's
``StatelessProcessGroup`` is for its NCCL engine. The trainer is rank 0; a worker is ``1 + its rank`` among the
server's workers (data-parallel index x workers per replica + its rank, as vLLM numbers them).

A tensor travels as its bytes (a ``uint8`` view, no copy): any dtype goes, bfloat16 and float8 included, and the
receiver rebuilds it from the name, dtype and shape the update route carried. Nothing is written to a file, so the
server needs no folder in common with the trainer. Every wait has the group's deadline (``timeout_s``).
"""

from __future__ import annotations

import datetime
import socket
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

#: The name of the gloo transfer in vLLM's weight-transfer registry (``--weight-transfer-config``).
GLOO_BACKEND = "amir_gloo"


@dataclass
class GlooInit:
    """``/init_weight_transfer_engine``'s ``init_info`` for the ``amir_gloo`` transfer.

    Attributes:
        master_address: Where the trainer's store listens.
        master_port: Its port.
        rank_offset: The first worker's rank in the group (the trainer is 0).
        world_size: The trainer and every worker of the server.
        timeout_s: Seconds any wait of the group may take before it fails.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdate:
    """``/update_weights``'s ``update_info``: the tensors of one bucket, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of its own over ``world_size`` processes, ``rank`` 0 serving the store at ``address``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("amir_push", store), rank, world_size, timeout)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32`` (what ``getattr(torch, name)`` reads back)."""
    return str(dtype).removeprefix("torch.")


def update_info(tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """The update route's ``update_info`` for one bucket (``GlooUpdate``'s fields), JSON only."""
    return {
        "names": [name for name, _ in tensors],
        "dtype_names": [dtype_name(t.dtype) for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }


def send(group, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Broadcast each tensor's bytes from rank 0, in order; the bytes sent."""
    sent = 0
    for _, tensor in tensors:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            group.broadcast(data, 0).wait()
        sent += data.numel()
    return sent


def receive(group, update: GlooUpdate) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``update``, each as rank 0 broadcast it, rebuilt from its dtype and shape on the CPU."""
    for name, dtype_text, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype_text))  # a tensor of its own dtype, filled in place
        if tensor.numel():
            group.broadcast(tensor.reshape(-1).view(torch.uint8), 0).wait()
        yield name, tensor


def send_into(group, tensors: list[tuple[str, torch.Tensor]], out: dict[str, object]) -> None:
    """``send`` for a thread of its own: the bytes sent, or the error, in ``out``.

    The pushing thread waits on the update route meanwhile, and raises what it finds here.
    """
    try:
        out["bytes"] = send(group, tensors)
    except Exception as err:  # noqa: BLE001  raised by the pushing thread
        out["error"] = err


def trainer_address(url: str) -> str:
    """This machine's address as the server at ``url`` reaches it: where the group's store listens.

    Loopback for a server on this machine.
    """
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the interface a route to it leaves by
        probe.connect((host, 9))
        return probe.getsockname()[0]
