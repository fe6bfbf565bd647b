"""The policy under FSDP2 without a whole copy anywhere: a sharded start, and a push streamed in buckets.

Built on the meta device and filled with each process's own rows of the checkpoint (the sharded start), pushed as a
stream of buckets gathered just in time.

The sharded start: the model is built from its config with its parameters on the meta device (no memory, no
initialisation; buffers such as rotary frequencies are computed as usual, they are not in checkpoints), LoRA added
and its factors initialised by peft on the CPU as in ``load_policy`` (the same random draws, in the same order), then
sharded with ``fully_shard``. Each process then reads from the safetensors files only the rows of each weight that
its shard holds (``safe_open(...).get_slice``): no process reads, holds or receives another's rows. A checkpoint that
transformers must convert on load (keys that are not the model's parameter names) is loaded whole instead, with a
line saying why.

The stream: ``weight_buckets`` yields the weights the engine takes (LoRA merged per matrix, as ``merged_state``) in
buckets of at most ``bucket_bytes`` (one tensor larger than that is a bucket of its own), each gathered from the
shards when it is reached. A process holds its shard, the bucket being gathered and the one its consumer still
reads: never the whole model. Every process iterates every bucket (each gather is a collective).
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

#: Default size of a pushed bucket: 256 MiB.
BUCKET_BYTES = 256 * 2**20


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside this get their parameters on the meta device; buffers stay where they are computed."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Each weight name of ``model_dir``'s safetensors checkpoint and its file (empty: it has none)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def is_peft(model) -> bool:
    """Whether ``model`` carries peft adapters."""
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_adapter")


def lora_linear(layer, prefix: str):
    """``layer``, checked to be a LoRA linear layer whose factors an engine can take merged or apart.

    Else a ``ValueError`` naming ``prefix``.
    """
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(layer, LoraLinear) or layer.fan_in_fan_out:
        raise ValueError(
            f"model.lora.target_modules: {prefix} is a {type(layer).__name__}; the rollout engine receives "
            "merged weights or linear adapters, and only LoRA on linear layers (fan_in_fan_out false) can be either; "
            "leave this module out of target_modules"
        )
    return layer


def initialise_adapters(model: torch.nn.Module, rng_state: torch.Tensor) -> None:
    """Give the LoRA factors of ``model`` (added by peft on the meta device) the values a loaded model gets.

    peft adds each layer's factors in module order: two float32 ``nn.Linear`` built (their own random init), then
    ``reset_lora_parameters`` (A drawn again, B zero), then a cast to the base layer's dtype. That is replayed here
    on the CPU from ``rng_state``, torch's random state just before ``get_peft_model``, which leaves the generator
    where peft left it on a loaded model: the factors, and every later draw, are the ones ``load_policy`` gives.
    """
    from peft.tuners.lora import LoraLayer

    torch.set_rng_state(rng_state)
    with torch.no_grad():
        for _, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            base_dtype = layer.get_base_layer().weight.dtype
            for adapter in list(layer.lora_A.keys()):
                factors = (layer.lora_A[adapter], layer.lora_B[adapter])
                for factor in factors:
                    factor.to_empty(device="cpu").float().reset_parameters()
                layer.reset_lora_parameters(adapter, True)  # LoraConfig's default init, as load_policy asks
                for factor in factors:
                    factor.to(dtype=base_dtype)


def _base_name(name: str) -> str:
    # base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight -> model.layers.0.self_attn.q_proj.weight
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def checkpoint_names(model: torch.nn.Module, files: dict[str, Path]) -> tuple[dict[str, str], list[str]]:
    """The checkpoint's name of each of ``model``'s weights, and the weights it lacks.

    The weights: its parameters (tied ones once) and its persistent buffers; LoRA factors are not the checkpoint's.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    if hasattr(model, "get_base_model"):  # peft
        prefix = getattr(model.get_base_model(), "base_model_prefix", "") or ""
    found, missing = {}, []
    persistent = set(model.state_dict().keys())
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in persistent]
    for name in names:
        if "lora_" in name:
            continue
        base = _base_name(name)
        candidates = [base, base.removeprefix(f"{prefix}."), f"{prefix}.{base}"] if prefix else [base]
        key = next((c for c in candidates if c in files), None)
        if key is None:
            missing.append(base)
        else:
            found[name] = key
    return found, missing


@dataclass
class ShardedStart:
    """Why a policy can (``names``) or cannot (``reason``) start sharded from ``model_dir``."""

    files: dict[str, Path]
    names: dict[str, str]
    reason: str | None


def plan_sharded_start(model: torch.nn.Module, model_dir: Path) -> ShardedStart:
    """Whether ``model`` (built on the meta device) can be filled from ``model_dir``'s files name for name."""
    files = checkpoint_files(model_dir)
    if not files:
        return ShardedStart(files, {}, f"{model_dir} has no safetensors weights")
    names, missing = checkpoint_names(model, files)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        reason = f"{model_dir}'s safetensors files do not hold {shown} under the model's names"
        return ShardedStart(files, names, reason)
    return ShardedStart(files, names, None)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give ``model``'s meta shards memory on ``device``, uninitialised.

    The parameters and buffers that already had values (LoRA factors, rotary frequencies) keep them.
    """
    kept = {name: _local(p).detach().clone() for name, p in model.named_parameters() if not _local(p).is_meta}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in kept:
                _local(p).copy_(kept[name])
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


def reshard(model: torch.nn.Module) -> None:
    """Free what FSDP2 gathered for a forward without a backward: every module holds its shard alone again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fill_shards(model: torch.nn.Module, start: ShardedStart, load_dtype: torch.dtype) -> int:
    """Copy into each of ``model``'s weights (FSDP2 shards on dim 0, or whole) its rows of the checkpoint.

    Values pass through ``load_dtype`` (as ``from_pretrained(dtype=load_dtype)``), then the weight's dtype.
    Returns the bytes read.
    """
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, key in start.names.items():
        by_file.setdefault(start.files[key], []).append((name, key))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    read = 0
    with torch.no_grad():
        for file, pairs in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name, key in pairs:
                    target = tensors[name]
                    local, rows = _local(target), _rows(target)
                    part = f.get_slice(key)
                    whole = tuple(part.get_shape())
                    if whole != tuple(target.shape):
                        shape = list(target.shape)
                        raise ValueError(f"{file}: {key} has shape {list(whole)}, the model's {name} {shape}")
                    values = part[rows[0] : rows[1]] if rows is not None and len(whole) else part[:]
                    if tuple(values.shape) != tuple(local.shape):
                        raise ValueError(f"{name}: the shard holds {list(local.shape)}, rows {rows} of the file give "
                                         f"{list(values.shape)}")  # fmt: skip
                    local.copy_(values.to(load_dtype).to(local.dtype))
                    read += values.numel() * values.element_size()
    return read


def _rows(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The rows of ``tensor`` (a DTensor sharded on dim 0 over one mesh dimension) this process holds; ``None``: all."""
    placements = getattr(tensor, "placements", None)
    if placements is None or tensor.dim() == 0:
        return None
    from torch.distributed.tensor import Shard

    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"a sharded start reads row shards; this parameter is placed as {placements}")
    mesh = tensor.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    per = -(-tensor.shape[0] // size)  # torch.chunk's rows per shard; the last ones may hold fewer or none
    return min(rank * per, tensor.shape[0]), min((rank + 1) * per, tensor.shape[0])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: its shard when it is a DTensor, else all of it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor.data


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """All of ``tensor``: gathered from every process when it is an FSDP2 shard (a DTensor).

    A row shard (FSDP2's) is gathered straight into one buffer of the whole tensor's rows rounded up to the shards'
    (``all_gather_into_tensor``), then cut to its rows without a copy: the gather holds the tensor once, where
    ``full_tensor`` holds it twice (its pieces, then their concatenation).
    """
    if not hasattr(tensor, "full_tensor"):
        return tensor
    rows = _rows(tensor) if _is_row_shard(tensor) else None
    if rows is None:
        return tensor.full_tensor()
    import torch.distributed as dist

    mesh, local = tensor.device_mesh, tensor.to_local().detach()  # values only: a push is no part of a graph
    per = -(-tensor.shape[0] // mesh.size())
    with torch.no_grad():
        if local.shape[0] != per:  # the last shards hold fewer rows (or none): padded to the others'
            local = torch.cat([local, local.new_zeros(per - local.shape[0], *local.shape[1:])])
        gathered = local.new_empty(per * mesh.size(), *local.shape[1:])
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=mesh.get_group())
    return gathered[: tensor.shape[0]]


def _is_row_shard(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import Shard

    placements = tensor.placements
    return tensor.dim() > 0 and len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0


# ---------------------------------------------------------------------------------------------- the streamed push
class Planned(NamedTuple):
    """One tensor of a push: the engine's name for it, its shape and dtype, and the state-dict keys it is made of.

    Its first three fields are what a consumer that writes a file needs first (``engines.server_setup.Planned``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str
    lora: tuple[str, str, str, float] | None = None  # (A key, B key, adapter, scaling) merged into ``key``

    @property
    def nbytes(self) -> int:
        """Its size once gathered."""
        return math.prod(self.shape) * self.dtype.itemsize


def push_plan(model: torch.nn.Module, merge: bool = True) -> list[Planned]:
    """What a push sends, in order, known without gathering anything.

    LoRA factors are left out, merged into their base weight when ``merge``; each tensor has the base model's name.
    """
    state = model.state_dict()
    layers = {}
    if is_peft(model) and merge:
        from peft.tuners.lora import LoraLayer

        layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    plan = []
    for key, tensor in state.items():
        if "lora_" in key:
            continue
        lora = None
        if merge and ".base_layer." in key and key.endswith(".weight"):
            prefix = key[: key.index(".base_layer.")]
            layer = lora_linear(layers[prefix], prefix)
            for adapter in layer.active_adapters:
                a, b = f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"
                if a in state and b in state:
                    lora = (a, b, adapter, layer.scaling[adapter])
        plan.append(Planned(_base_name(key), tuple(tensor.shape), tensor.dtype, key, lora))
    return plan


def buckets_of(plan: list, bucket_bytes: int) -> list[list]:
    """``plan`` cut in order into buckets of at most ``bucket_bytes`` (a larger tensor is a bucket alone).

    An item is ``(name, shape, dtype, ...)``: a ``Planned``, or a plain triple.
    """
    out: list[list] = []
    size = 0
    for item in plan:
        nbytes = math.prod(item[1]) * item[2].itemsize
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def weight_buckets(
    model: torch.nn.Module, merge: bool = True, bucket_bytes: int = BUCKET_BYTES, plan: list[Planned] | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The pushed weights, bucket by bucket, each gathered from the FSDP2 shards when reached (``push_plan``).

    A LoRA weight is ``W + scale * B @ A`` computed in float32 and rounded once, out of place (as ``merged_state``).
    """
    state = model.state_dict()
    for bucket in buckets_of(plan if plan is not None else push_plan(model, merge), bucket_bytes):
        out: list[tuple[str, torch.Tensor]] = []  # the last bucket's list is dropped here, before any gather
        for item in bucket:
            tensor = _full(state[item.key])
            if item.lora is not None:
                a_key, b_key, _, scaling = item.lora
                a, b = _full(state[a_key]), _full(state[b_key])
                tensor = (tensor.float() + (b.float() @ a.float()) * scaling).to(tensor.dtype)
            out.append((item.name, tensor.detach()))
        yield out


class WeightStream:
    """The pushed weights one tensor at a time (``weight_buckets`` flattened).

    Their ``plan`` is known before the first is gathered: a consumer that writes a file can write its header first.
    """

    def __init__(self, model: torch.nn.Module, merge: bool = True, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.plan = push_plan(model, merge)
        self._buckets = weight_buckets(model, merge, bucket_bytes, self.plan)
        self._current: deque[tuple[str, torch.Tensor]] = deque()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        # Each tensor leaves the bucket as it is handed on: once the consumer lets it go, it is freed, and the next
        # bucket is gathered with nothing of this one left here.
        while not self._current:
            bucket = next(self._buckets)  # StopIteration at the end of the last bucket
            self._current = deque(bucket)
            bucket.clear()  # the generator's own list: its references would outlive the hand-over
        return self._current.popleft()
