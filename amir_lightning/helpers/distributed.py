"""Process-group helpers: reductions that are no-ops in a single process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def world_size() -> int:
    """Processes in the default group (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum", device: torch.device | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over all processes (``sum``, ``max``, ``min`` or ``mean``); returns a new CPU tensor.

    ``device`` is where the collective runs (CUDA for NCCL); defaults to the tensor's device.
    """
    if world_size() == 1:
        return tensor.detach().clone().cpu()
    out = tensor.detach().clone().to(device or tensor.device)
    dist.all_reduce(out, op=_OPS["sum" if op == "mean" else op])
    if op == "mean":
        out /= world_size()
    return out.cpu()


@dataclass(frozen=True)
class Collectives:
    """The run's reductions over processes on one ``device`` (CUDA for NCCL), as a value a lower part can call.

    Every process must call each as often, in the same order.
    """

    device: torch.device | None = None

    def sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over processes."""
        return all_reduce(values, "sum", self.device)

    def max_over_processes(self, values: list[float]) -> list[float]:
        """``values``, each the largest over processes."""
        return all_reduce(torch.tensor(values, dtype=torch.float64), "max", self.device).tolist()


def mean_over_processes(values: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    """Each key's mean over the processes that have it; every process gets every key any process has.

    Every process must call it (two collectives). A key some processes lack (a reward function that logged a
    metric only on some) is averaged over those that have it, rather than mismatching the others' values.
    """
    if world_size() == 1:
        return dict(values)
    gathered: list[list[str] | None] = [None] * world_size()
    dist.all_gather_object(gathered, sorted(values))
    keys = sorted({k for ks in gathered for k in ks})
    sums = torch.tensor([[float(values[k]), 1.0] if k in values else [0.0, 0.0] for k in keys], dtype=torch.float64)
    totals = all_reduce(sums.reshape(-1, 2), "sum", device)
    return {k: (total / count).item() for k, (total, count) in zip(keys, totals)}


def sum_shares(stats: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Sum scalar ``stats`` over processes (one collective)."""
    keys = sorted(stats)
    if world_size() == 1 or not keys:
        return dict(stats)
    summed = all_reduce(torch.stack([torch.as_tensor(stats[k]).float().cpu() for k in keys]), "sum", device)
    return {**stats, **dict(zip(keys, summed))}


def rank_zero_first(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0, then on the other ranks (for caches that rank 0 fills and the others read).

    Every process must call it. Hugging Face ``save_pretrained`` writes only on rank 0 once a process group exists,
    so the other ranks must not race rank 0 to build the same cached model.
    """
    if world_size() == 1:
        return fn()
    if dist.get_rank() == 0:
        out = fn()
        dist.barrier()
        return out
    dist.barrier()
    return fn()


def global_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if world_size() > 1 else 0


def from_rank_zero(fn: Callable[[], T]) -> T:
    """``fn()`` run on global rank 0 and its (picklable) result sent to every process; every process must call it."""
    value = fn() if global_rank() == 0 else None
    if world_size() > 1:
        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        value = shared[0]
    return value


def gather_to_rank_zero(value: T) -> list[T] | None:
    """Every process's (picklable) ``value`` in rank order on global rank 0, ``None`` elsewhere.

    Every process must call it. Only rank 0 receives (``gather_object``): a value as large as a copy of the weights
    is not sent to every process.
    """
    if world_size() == 1:
        return [value]
    gathered = [None] * world_size() if global_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
