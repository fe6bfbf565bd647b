"""The vLLM servers one ``VLLMServerEngine`` generates from: each a ``Replica``, every one holding the same weights.

A rollout's groups are spread over the replicas, whole (a prompt's samples share its prefix cache on one server),
balanced by the tokens they may take (``assign``); every push reaches every replica, and the sync check reads each
one back (``ReplicaView``: one replica seen as an engine of its own, ``RolloutEngine.copies``). Each replica is a
server of its own for the fault machinery (``helpers/http.py``): one that dies, falls silent or holds other weights
stops the run with a line naming it (``the vLLM server (replica 2 of 2) at http://...``).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from amir_lightning.engines.digest import ColumnSample, Reading
from amir_lightning.engines.shards import merge_workers
from amir_lightning.engines.vllm_worker import decode
from amir_lightning.helpers.http import Endpoint, reading

if TYPE_CHECKING:
    from amir_lightning.engines.server import VLLMServerEngine
    from amir_lightning.helpers.serving import ServerProcess

T = TypeVar("T")


@dataclasses.dataclass
class Replica:
    """One vLLM server of the engine.

    Attributes:
        index: Its place among the engine's replicas (0 first).
        count: How many replicas the engine has.
        endpoint: Where its requests go and how its faults are named.
        server: Its process, when this run started it.
        workers: Its workers (``tensor_parallel_size`` of them), counted at the first gloo push.
        group: The trainer's end of its gloo transfer, joined for each push.
    """

    index: int
    count: int
    endpoint: Endpoint
    server: ServerProcess | None = None
    workers: int | None = None
    group: Any = None

    @property
    def url(self) -> str:
        """Its address."""
        return self.endpoint.url

    @property
    def label(self) -> str:
        """How the sync check names it (empty for an engine of one server)."""
        return f"replica {self.index + 1} of {self.count} at {self.url}" if self.count > 1 else ""


def server_name(index: int, count: int) -> str:
    """A replica's name in messages: ``the vLLM server``, or ``the vLLM server (replica 2 of 3)``."""
    return "the vLLM server" if count == 1 else f"the vLLM server (replica {index + 1} of {count})"


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


def each(replicas: Sequence[Replica], fn: Callable[[Replica], T]) -> list[T]:
    """``fn`` on every replica at once (their routes block until their own workers answer).

    The first error, in the replicas' order, is raised once every call has ended.
    """
    if len(replicas) == 1:
        return [fn(replicas[0])]
    with ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="amir-replica") as pool:
        futures = [pool.submit(fn, replica) for replica in replicas]
    return [future.result() for future in futures]


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


class ReplicaView:
    """One replica of a ``VLLMServerEngine`` as the sync check reads it: its weights, adapters and probe scores."""

    def __init__(self, engine: VLLMServerEngine, replica: Replica) -> None:
        self.engine, self.replica = engine, replica

    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]]:
        """What the replica's workers hold of the sampled columns."""
        body = {"method": "amir_held_weights", "args": [json.dumps([columns.seed, columns.count])]}
        answer = self.engine._post("/collective_rpc", body, replica=self.replica)
        with reading(self.replica.endpoint, "/collective_rpc", answer):
            return merge_workers([decode(result) for result in answer["results"]])

    def held_adapters(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The LoRA factors the replica serves."""
        answer = self.engine._post("/collective_rpc", {"method": "amir_held_adapters"}, replica=self.replica)
        with reading(self.replica.endpoint, "/collective_rpc", answer):
            return decode(answer["results"][0])

    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """The probe's log-probs under the replica's weights."""
        return self.engine.score(prompt, completion, replica=self.replica)
