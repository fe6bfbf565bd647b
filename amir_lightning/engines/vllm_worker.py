"""What runs inside a vLLM engine's workers: reading back the weights they hold, and receiving pushed weights.

Both rollout engines use it: ``VLLMEngine`` calls these functions on its in-process workers through
``LLM.collective_rpc``; ``VLLMServerEngine``'s server loads ``AmirWorkerExtension`` into its workers
(``--worker-extension-cls``), whose methods its ``/collective_rpc`` route calls by name, and receives weights through
``FileWeightTransfer``, a weight-transfer backend for vLLM's RL routes (``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``) that loads a safetensors file the trainer wrote (``/dev/shm`` where
there is one). vLLM's own backends (NCCL, CUDA IPC) need CUDA; this one works on any machine where the trainer and
the server share a file system.

Nothing here imports vLLM at module level; the backend registers itself when this module is imported into a vLLM
server started with ``AMIR_VLLM_SERVER=1`` (the worker extension is imported before the model loads).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from dataclasses import dataclass

import torch
from typing_extensions import override

from amir_lightning.engines.digest import ColumnSample, Reading, WeightLayout, WeightSlot, tensor_digest
from amir_lightning.engines.shards import blocks_of, param_readings, part_rows

#: The name of ``FileWeightTransfer`` in vLLM's weight-transfer registry (``--weight-transfer-config``).
FILE_BACKEND = "amir_file"


def _named_parameters(model) -> tuple[dict[int, str], dict[str, torch.nn.Parameter]]:
    """Each parameter's first name (tied ones share a tensor), and every name with its parameter."""
    first: dict[int, str] = {}
    every = dict(model.named_parameters(remove_duplicate=False))
    for name, param in every.items():
        first.setdefault(id(param), name)
    return first, every


def layout_of(worker) -> tuple:
    """Plain data for ``VLLMLayout``: the weight mapper, packed modules, aliases, dtypes, readable copies, part rows."""
    model = worker.model_runner.get_model()
    first, every = _named_parameters(model)
    model_dtype = worker.model_runner.model_config.dtype
    loaded = _load_dtypes(model)
    kernels = {first[id(w)] for w in _kernels(model).values()}
    whole = {first[id(p)] for p in every.values() if p.numel()}
    aliases, dtypes, load_dtypes = {}, {}, {}
    for name, param in every.items():
        key = first[id(param)]
        aliases[name] = key
        dtypes[key] = param.dtype
        load = loaded.get(key, model_dtype)
        if load != param.dtype and load.itemsize < param.dtype.itemsize:
            load_dtypes[key] = load  # loaded narrow, kept wide (vLLM's CPU kernels keep biases in float32)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    parts = {}  # fused tensor -> the row where each of its parts starts
    for module in model.modules():
        starts = part_rows(module)
        for param in module.parameters(recurse=False) if starts else ():
            parts[first[id(param)]] = starts
    return mapper, packed, aliases, dtypes, load_dtypes, kernels, whole, parts


def _load_dtypes(model) -> dict[str, torch.dtype]:
    """The dtype each parameter is loaded in (vLLM's record of the checkpoint format, kept for reloading)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return {}
    out = {}
    for module_name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        for name, meta in (info.restore_metadata[0] if info is not None else {}).items():
            out[f"{module_name}.{name}" if module_name else name] = meta.dtype
    return out


def _kernels(model) -> dict[torch.nn.Module, torch.nn.Parameter]:
    """The modules whose weight vLLM's CPU backend packed into a GEMM kernel (``cpu_linear``), with that weight."""
    found = {}
    for module in model.modules():
        kernel, weight = getattr(module, "cpu_linear", None), getattr(module, "weight", None)
        if kernel is not None and isinstance(weight, torch.nn.Parameter):
            found[module] = weight
    return found


def _owners(model) -> dict[int, tuple[torch.nn.Module, str]]:
    """Each parameter's layer and its name there (the first, for a tensor that several layers share)."""
    owners = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (module, attr))
    return owners


@torch.no_grad()
def read_back(worker, columns: ColumnSample) -> dict[str, list[Reading]]:
    """Digests of the weights this worker computes with, block by block at their places (``engines/shards.py``)."""
    model = worker.model_runner.get_model()
    first, _ = _named_parameters(model)
    owners = _owners(model)
    held: dict[str, list[Reading]] = {}
    for name, param in model.named_parameters():
        if param.numel():
            held.setdefault(name, []).extend(param_readings(*owners[id(param)], param))
    for module, weight in _kernels(model).items():
        if id(weight) in first:
            held.setdefault(first[id(weight)], []).extend(_kernel_readings(module, owners[id(weight)][1], columns))
    return held


def _kernel_readings(module, attr: str, columns: ColumnSample, rows: int = 512) -> list[Reading]:
    """Digests of ``columns`` of the weight a CPU GEMM kernel holds: ``kernel(I[cols]) = W[:, cols].T``.

    The columns are chosen in the full tensor; a row-parallel shard reads those that fall in its own.
    """
    weight = module.weight
    width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    width = width or weight.shape[-1]
    row_parallel = hasattr(module, "input_is_parallel") and getattr(module, "tp_size", 1) > 1
    first_col = module.tp_rank * width if row_parallel else 0
    picked = columns.pick(module.input_size if row_parallel else width)
    picked = picked[(picked >= first_col) & (picked < first_col + width)]
    if not len(picked):
        return []
    read = []
    for block in (picked - first_col).split(rows):
        eye = torch.zeros(len(block), width, dtype=weight.dtype, device=weight.device)
        eye[torch.arange(len(block)), block.to(eye.device)] = 1
        read.append(module.cpu_linear(eye, weight, None))  # [block, N]: columns of W
    columns_of_w = torch.cat(read).T  # [N, picked]
    readings = []
    for block in blocks_of(module, attr, columns_of_w.shape[0], width):
        rows_read = columns_of_w[block.start : block.start + block.rows]
        readings.append(Reading(tensor_digest(rows_read, block.place, picked), True, block.place))
    return readings


class VLLMLayout(WeightLayout):
    """Hugging Face names -> vLLM's tensors: the model's ``hf_to_vllm_mapper``, else its packed modules."""

    def __init__(
        self,
        mapper,
        packed: dict,
        aliases: dict,
        dtypes: dict,
        load_dtypes: dict,
        kernels: set,
        whole: set,
        parts: dict,
    ) -> None:
        self.mapper, self.packed, self.aliases = mapper, packed, aliases
        self.dtypes, self.load_dtypes, self.kernels, self.whole = dtypes, load_dtypes, kernels, whole
        self.parts = parts

    @override
    def slot(self, name: str) -> WeightSlot | None:
        target = self.mapper.map_name(name) if self.mapper is not None else name
        if target is None:
            return None  # vLLM drops it on load
        part, index = "", 0
        for fused, pieces in self.packed.items():
            for i, piece in enumerate(pieces):  # q_proj is the q part of qkv_proj, whether or not the mapper renamed it
                if f".{piece}." in f".{name}" and (f".{fused}." in target or f".{piece}." in target):
                    target, part, index = target.replace(f".{piece}.", f".{fused}.", 1), piece, i
        key = self.aliases.get(target)
        if key is None and "." in target:  # a layer wrapped by vLLM's LoRA (enable_lora) keeps it as its base layer
            layer, _, attr = target.rpartition(".")
            key = self.aliases.get(f"{layer}.base_layer.{attr}")
        if key is None:
            return None
        starts = self.parts.get(key)
        return WeightSlot(
            key,
            part,
            self.dtypes[key],
            load_dtype=self.load_dtypes.get(key),
            kernel=key in self.kernels,
            whole=key in self.whole,
            row=starts[index] if part and starts else 0,
        )

    @override
    def adapter_place(self, module: str) -> tuple[str, int] | None:
        slot = self.slot(f"{module}.weight")
        if slot is None:
            return None
        layer = slot.key.removesuffix(".weight").removesuffix(".base_layer")
        pieces = self.packed.get(layer.rsplit(".", 1)[-1]) or []
        return layer, pieces.index(slot.part) if slot.part in pieces else 0


@torch.no_grad()
def read_adapters(worker, lora_id: int) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The LoRA factors this worker computes with for adapter ``lora_id``, by LoRA layer and slice.

    Each slice is ``(A [rank, in], B [out, rank])`` at the engine's rank (``max_lora_rank``), copied to the CPU;
    ``{}`` when the adapter holds no slot.
    """
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        return {}
    slot = manager.lora_index_to_id.index(lora_id)
    held = {}
    for name, module in manager.modules.items():
        a, b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if isinstance(a, tuple) and isinstance(b, tuple):  # linear layers: one [loras, 1, rank, in] per slice
            held[name] = [(ai[slot, 0].cpu().clone(), bi[slot, 0].cpu().clone()) for ai, bi in zip(a, b)]
    return held


# ---------------------------------------------------------------------- a vLLM server's side
def encode(value) -> str:
    """A worker's answer as text for vLLM's ``/collective_rpc``, which returns strings (``decode`` reads it)."""
    return base64.b64encode(pickle.dumps(value)).decode()


def decode(text: str):
    """The answer ``encode`` made, read by the trainer from the server it started or was given."""
    return pickle.loads(base64.b64decode(text))  # noqa: S301 (the server is the trainer's own)


class AmirWorkerExtension:
    """Methods a vLLM server's workers gain (``--worker-extension-cls``), called through ``/collective_rpc``."""

    def amir_weight_slots(self, names: str) -> str:
        """Where this worker keeps each of the Hugging Face ``names`` (a JSON list): encoded ``{name: WeightSlot}``."""
        layout = VLLMLayout(*layout_of(self))
        return encode({name: layout.slot(name) for name in json.loads(names)})

    def amir_adapter_places(self, modules: str) -> str:
        """``VLLMLayout.adapter_place`` of each of the trainer's LoRA layers ``modules`` (a JSON list), encoded."""
        layout = VLLMLayout(*layout_of(self))
        return encode({module: layout.adapter_place(module) for module in json.loads(modules)})

    def amir_worker_rank(self) -> int:
        """This worker's rank among the server's (the trainer counts the workers that answer)."""
        return int(self.rank)

    def amir_held_adapters(self) -> str:
        """``read_adapters`` of this worker for the one adapter it holds (the server serves at most one), encoded."""
        held = [i for i in self.model_runner.lora_manager._adapter_manager.lora_index_to_id if i is not None]
        return encode(read_adapters(self, held[0]) if len(held) == 1 else {})

    def amir_receive_adapter(self, spec: str) -> str:
        """Receive a pushed adapter over this server's ``amir_gloo`` group and write it as a Peft folder here.

        ``spec`` (JSON): ``name``, ``rank``, ``alpha`` and ``update`` (``GlooUpdate``'s fields) of the factors the
        trainer broadcasts meanwhile. The folder is on the server's own machine (its temporary folder), so an adapter
        push needs no folder in common with the trainer; vLLM's ``/v1/load_lora_adapter`` then loads it, and
        ``amir_remove_adapter`` deletes it. Its path is the answer.
        """
        import tempfile
        from pathlib import Path

        from amir_lightning.engines.adapters import write_adapter
        from amir_lightning.engines.transfer import GlooUpdate, receive

        given = json.loads(spec)
        group = getattr(getattr(self, "weight_transfer_engine", None), "group", None)
        if group is None:
            raise RuntimeError("the server has no amir_gloo group for an adapter: /init_weight_transfer_engine first")
        factors = dict(receive(group, GlooUpdate(**given["update"])))
        folder = Path(tempfile.mkdtemp(prefix=ADAPTER_PREFIX)) / str(given["name"])
        dtype = self.model_runner.model_config.dtype
        write_adapter(folder, factors, int(given["rank"]), dtype, int(given["alpha"]))
        return str(folder)

    def amir_remove_adapter(self, folder: str) -> bool:
        """Delete an adapter folder ``amir_receive_adapter`` wrote (vLLM holds the adapter in memory by now)."""
        import shutil
        import tempfile
        from pathlib import Path

        parent = Path(folder).parent
        if parent.parent != Path(tempfile.gettempdir()) or not parent.name.startswith(ADAPTER_PREFIX):
            raise ValueError(f"{folder} is not a folder amir_receive_adapter wrote")
        shutil.rmtree(parent, ignore_errors=True)
        return True

    def amir_held_weights(self, columns: str) -> str:
        """``read_back`` of this worker on ``columns`` (JSON ``[seed, count]``), encoded.

        Requests carry JSON only: the server never unpickles what a client sends.
        """
        seed, count = json.loads(columns)
        return encode(read_back(self, ColumnSample(int(seed), None if count is None else int(count))))


#: The start of the name of each temporary folder a server's worker writes a received adapter into.
ADAPTER_PREFIX = "amir_adapter_"


@dataclass
class FileInit:
    """``/init_weight_transfer_engine``'s ``init_info`` for ``FileWeightTransfer``: nothing to set up."""


@dataclass
class FileUpdate:
    """``/update_weights``'s ``update_info`` for ``FileWeightTransfer``.

    Attributes:
        path: A safetensors file of Hugging Face-named tensors, which the trainer deletes after the update.
    """

    path: str


def transfer_classes() -> dict[str, type]:
    """Our weight transfers by their registry names, built on vLLM's ``WeightTransferEngine``.

    ``amir_file`` (``FileWeightTransfer``) and ``amir_gloo`` (``GlooWeightTransfer``); vLLM is imported only here,
    inside a vLLM process.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from amir_lightning.engines.transfer import GLOO_BACKEND, GlooInit, GlooUpdate, gloo_group, receive

    class LayerwiseTransfer(WeightTransferEngine):
        """Weights in checkpoint format, loaded layer by layer as vLLM's checkpoint-format backends do.

        ``weights`` says where they come from.
        """

        supports_draft_weight_update = False

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict) -> None:  # the base class synchronises an accelerator
            self.receive_weights(self.parse_update_info(update_info))
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def receive_weights(self, update_info) -> None:
            self.model.load_weights(self.weights(update_info))

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            repack_tied_head(self.model)

        def shutdown(self) -> None:
            pass

    class FileWeightTransfer(LayerwiseTransfer):
        """Weights from a safetensors file in a folder the trainer and the server share."""

        init_info_cls, update_info_cls = FileInit, FileUpdate

        def init_transfer_engine(self, init_info) -> None:
            del init_info

        def weights(self, update_info):
            from safetensors.torch import load_file

            return load_file(update_info.path, device="cpu").items()

    class GlooWeightTransfer(LayerwiseTransfer):
        """Weights broadcast by the trainer over a gloo group of their own, loaded as they arrive.

        Nothing is written to a file, and the server shares no folder with the trainer (``engines/transfer.py``).
        """

        init_info_cls, update_info_cls = GlooInit, GlooUpdate
        group = None

        def init_transfer_engine(self, init_info) -> None:
            self.shutdown()  # a run that reaches this server again brings a group of its own
            config = self.parallel_config  # ranks as vLLM numbers its own NCCL transfer's workers
            rank = config.data_parallel_index * config.world_size + config.rank + init_info.rank_offset
            self.group = gloo_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
            )

        def weights(self, update_info):
            if self.group is None:
                raise RuntimeError("the amir_gloo weight transfer has no group: /init_weight_transfer_engine first")
            return receive(self.group, update_info)

        def shutdown(self) -> None:
            self.group = None

    return {FILE_BACKEND: FileWeightTransfer, GLOO_BACKEND: GlooWeightTransfer}


def repack_tied_head(model: torch.nn.Module) -> None:
    """Repack a tied LM head's CPU kernel from the reloaded embedding.

    On CPU the LM head computes the logits from a packed copy of its weight; with tied embeddings a checkpoint-format
    reload updates the embedding but never the head (it has no weight of its own in the checkpoint), so the logits
    would keep the old weights. The exact sync check reads that kernel back, and stops such a run.
    """
    for module in model.modules():
        if getattr(module, "cpu_linear", None) is not None and type(module).__name__ == "ParallelLMHead":
            if module.weight.numel():
                module.quant_method.process_weights_after_loading(module)


def register_transfers() -> None:
    """Add ``FileWeightTransfer`` and ``GlooWeightTransfer`` to vLLM's weight-transfer registry, once per process.

    Their names there: ``amir_file`` and ``amir_gloo``.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, engine in transfer_classes().items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)


if "vllm" in sys.modules and os.environ.get("AMIR_VLLM_SERVER"):  # imported into a server's worker
    register_transfers()
