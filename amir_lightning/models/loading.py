"""Loading a policy for training: dtype, gradient checkpointing, optional LoRA (peft), and engine-ready weights."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from amir_lightning.helpers.extras import missing
from amir_lightning.models import attention
from amir_lightning.models.sharded import (
    WeightStream,
    _base_name,
    _full,
    initialise_adapters,
    is_peft,
    lora_linear,
    parameters_on_meta,
)

__all__ = ["is_peft", "lora_linear"]  # re-exported: their home is models/sharded.py


@dataclass
class LoraSettings:
    """LoRA adapters through peft (the paper: r = 16, alpha = 16 on every linear projection).

    Attributes:
        r: Adapter rank.
        alpha: Scaling numerator (scale = alpha / r).
        dropout: Dropout on the adapter input: must be 0. The engine samples without dropout, and the ratio of
            the policy-gradient loss compares the trained forward with the sampling one: with dropout, on-policy
            ratios spread around 1 (dropout 0.3: 0.65-1.62) and clipping cuts on-policy tokens.
        target_modules: Module names to adapt, or ``all-linear``.
    """

    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = field(default="all-linear")

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0:
            raise ValueError(f"model.lora needs r >= 1 and alpha > 0; got {self}")
        if self.dropout != 0:
            raise ValueError(
                f"model.lora.dropout {self.dropout}: must be 0. The engine samples without dropout and the loss's "
                "ratio compares the training forward with the sampling one; with dropout on-policy ratios are not 1"
            )


def load_policy(
    model_dir: Path,
    frozen_dtype: torch.dtype = torch.float32,
    trainable_dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    lora: LoraSettings | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    on_meta: bool = False,
):
    """The trainable policy from ``model_dir``.

    Trainable weights are stored in ``trainable_dtype`` and frozen ones in ``frozen_dtype``: with LoRA the base model
    is frozen, without it every weight trains. ``attn_implementation``: Hugging Face's (``sdpa``, ``eager``,
    ``flash_attention_2``...) or ours, ``varlen`` (``amir_lightning.models.attention``); ``None`` takes
    transformers' default.

    ``on_meta``: built from the config with its weights on the meta device, none read (the sharded start,
    ``models/sharded.py``); LoRA factors are initialised on the CPU all the same, with the same random draws.
    """
    from transformers import AutoModelForCausalLM

    load_dtype = frozen_dtype if lora is not None else trainable_dtype
    config = without_dropout(model_dir, trust_remote_code)
    if on_meta:
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(
                config, dtype=load_dtype, trust_remote_code=trust_remote_code, **_attention(attn_implementation)
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=config,
            dtype=load_dtype,
            trust_remote_code=trust_remote_code,
            **_attention(attn_implementation),
        )
    model.config.use_cache = False
    for module in model.modules():  # a dropout a model's code sets without its config
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as err:
            raise missing("model.lora", "lora") from err
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        rng_state = torch.get_rng_state()
        model = get_peft_model(model, config, autocast_adapter_dtype=False)  # the dtype is set just below
        if on_meta:  # peft left the factors on the meta device: their values, as on a loaded model
            initialise_adapters(model, rng_state)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad and param.dtype != trainable_dtype:
                param.data = param.data.to(trainable_dtype)
    return model


def without_dropout(model_dir: Path, trust_remote_code: bool = False):
    """``model_dir``'s config with every dropout probability 0 (``attention_dropout``, GPT-2's ``attn_pdrop``...).

    RL's log-prob ratios compare the forward that trains with the one that sampled (the engine, which has no
    dropout): the policy trains in train mode (gradient checkpointing needs it), so dropout must be off in the model
    itself. Attention dropout is a float the attention layers read, not a ``Dropout`` module, so it is set in the
    config before the model is built. An exported policy's config says 0 too: it is the model that trained.
    """
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    configs = [config, *(value for value in vars(config).values() if isinstance(value, PretrainedConfig))]
    for part in configs:  # a multimodal model's text config too
        for key, value in vars(part).items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(part, key, 0.0)
    return config


def policy_shapes(
    model_dir: Path, lora: LoraSettings | None = None, trust_remote_code: bool = False
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Names and shapes of the policy's weights, and the names of the frozen ones, without reading any weight.

    With LoRA the base weights are frozen and checkpoints leave them out (``AmirGRPOModule.state_dict``). The model
    is built on the meta device from its config (and its LoRA adapters added), so a checkpoint can be checked
    against it in a second, before the weights are read and the engine starts.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            settings = LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules, task_type="CAUSAL_LM"
            )
            model = get_peft_model(model, settings, autocast_adapter_dtype=False)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad} if lora else set()
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}, frozen


def base_identity(model_dir: Path, source: str) -> dict[str, str]:
    """What identifies a base model for LoRA adapters: where it came from, and hashes of its config and weights.

    The weights' hash covers each weight file's size and its first and last MiB (the header and two ends of the
    data), so two fine-tunes of one architecture differ while a 6 GB model is fingerprinted in milliseconds.
    """
    config = Path(model_dir) / "config.json"
    weights = sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin"))
    digest = hashlib.sha256()
    for file in weights:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            digest.update(f.read(1 << 20))
    return {
        "source": source,
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "",
        "weights_sha256": digest.hexdigest(),
    }


def load_reference(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
):
    """A frozen copy of the initial policy, for the KL term or the referenced pair term."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, trust_remote_code=trust_remote_code, **_attention(attn_implementation)
    )
    return model.eval().requires_grad_(False)


def _attention(attn_implementation: str | None) -> dict[str, str]:
    if attn_implementation is None:
        return {}
    if attn_implementation == attention.NAME:
        attention.register()
    return {"attn_implementation": attn_implementation}


def shard_fsdp2(model, device_type: str, compute_dtype: torch.dtype = torch.float32) -> None:
    """Shard ``model`` with FSDP2 ``fully_shard`` over every process: each decoder layer, then the root.

    Every process is a data-parallel rank with its own prompt shard and engine, so the mesh is the whole world;
    ``ModelParallelStrategy``'s own mesh defaults to tensor parallelism across a node's devices, which this module
    does not apply (a data-parallel dimension of one process would leave the ranks' gradients unaveraged).
    Parameters are gathered in ``compute_dtype`` and gradients reduced in float32 .
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from amir_lightning.helpers.distributed import world_size

    mesh = init_device_mesh(device_type, (world_size(),), mesh_dim_names=("data_parallel",))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def is_sharded(model) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every process; a plain ``state_dict()`` when not sharded."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Every rank needs the whole model for its own engine; cpu_offload would leave ranks > 0 empty.
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


@contextmanager
def merged_state(model, merge: bool = True) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
    """Full weights under the base model's parameter names, with LoRA deltas added in; gathered under FSDP2.

    vLLM knows nothing of adapter names, so the engine gets merged weights. They are computed out of
    place, one matrix at a time: peft's in-place merge/unmerge would round the frozen base weights a little at
    every sync. The stream (``models.sharded.WeightStream``) gathers a bucket at a time from the FSDP2 shards, so
    no process holds the whole model. ``merge`` off: the base weights alone (for an engine that takes the adapters
    apart, ``adapter_state``).
    """
    yield WeightStream(model, merge)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The LoRA factors under Peft's saved names, ``B`` multiplied by its layer's scaling, float32, on the CPU.

    ``W x + B' (A x)`` is then the policy's forward, for an engine that serves the adapter with scale 1
    (``engines/adapters.py``). Only the factors are gathered under FSDP2, on every process.
    """
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        layer = lora_linear(layer, name)
        if len(layer.active_adapters) != 1:
            raise ValueError(f"{name} has {len(layer.active_adapters)} active adapters; an engine takes one")
        adapter = layer.active_adapters[0]
        a, b = (_full(factor[adapter].weight).detach().float() for factor in (layer.lora_A, layer.lora_B))
        key = f"base_model.model.{_base_name(name)}"
        out[f"{key}.lora_A.weight"] = a.cpu()
        out[f"{key}.lora_B.weight"] = (b * layer.scaling[adapter]).cpu()
    return out
