"""Mixed precision for RL fine-tuning: compute in bf16, keep trainable weights in float32.

Lightning's ``bf16-true`` casts the whole module, LoRA adapters included, to bf16 before the optimizer is built. At
RL learning rates (5e-6) AdamW's updates are then smaller than half a bf16 ulp of a LoRA A matrix (|A| ~ 0.01) and
round away (2 % of a LoRA A matrix's elements change in 20 steps, against 100 % in float32:
tests/test_precision.py). So the module owns precision:

- ``trainer.precision`` chooses the **compute** dtype only: ``32-true`` is float32; ``bf16-mixed`` and
  ``bf16-true`` both mean bfloat16 compute. Lightning's plugin is replaced by a no-op, so nothing casts the
  weights or the batches behind the module's back.
- Trainable weights, and so their gradients and the optimizer state, are stored in ``model.trainable_dtype``
  (float32 unless a user asks for bfloat16 by name). Frozen weights (the LoRA base model, the reference copy) are
  stored in ``model.dtype``, by default the compute dtype, which halves their memory.
- Under FSDP2 ``fully_shard`` casts the gathered parameters to the compute dtype and reduces gradients in float32
  (``MixedPrecisionPolicy``); otherwise every forward of the policy runs under ``torch.autocast``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import Precision

#: ``trainer.precision`` values the module supports, with the compute dtype each one means.
COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}


def dtype_by_name(name: str, key: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16``, ...); an error names the config ``key``."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{key} must be a floating torch dtype name like float32 or bfloat16, got {name!r}")
    return dtype


def compute_dtype(precision: str) -> torch.dtype:
    """The compute dtype that ``trainer.precision`` stands for; unsupported settings are an error naming the key."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(
            f"trainer.precision={precision!r} is not supported: use 32-true (float32) or bf16-mixed (bfloat16 "
            "compute, float32 trainable weights; bf16-true means the same here). float16 would need loss scaling, "
            "and 64-true / transformer-engine are untested."
        )
    return COMPUTE_DTYPES[precision]


#: Lightning's older names for its precision settings, as it reads them.
_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def check_precision(precision) -> None:
    """``trainer.precision`` as given (Lightning's older names too): an unsupported one is an error naming the key.

    The CLI checks it before anything starts, not after the engine has loaded the model.
    """
    if precision is not None:
        compute_dtype(_ALIASES.get(str(precision), str(precision)))


def take_over_precision(trainer) -> torch.dtype:
    """Replace the trainer's precision plugin by a no-op and return the compute dtype it asked for.

    Called from ``LightningModule.setup``, before ``configure_model`` and before the strategy would let the plugin
    cast the module (``bf16-true``) or the batches' float fields (advantages, log-probs) to bf16. The no-op keeps
    the dtype, so every later ``setup`` of the same trainer (``validate`` then ``fit``) computes in it too: once the
    plugin is replaced, ``trainer.precision`` reads ``32-true``.
    """
    plugin = trainer.strategy.precision_plugin
    if isinstance(plugin, ComputeDtype):
        return plugin.compute_dtype
    dtype = compute_dtype(trainer.precision)
    trainer.strategy.precision_plugin = ComputeDtype(dtype)
    return dtype


class ComputeDtype(Precision):
    """Lightning's do-nothing precision plugin, remembering the compute dtype that ``trainer.precision`` chose.

    Args:
        compute_dtype: The dtype the module computes in (``COMPUTE_DTYPES``).
    """

    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype


def check_strategy(strategy) -> None:
    """Refuse strategies the module does not support, in one line that names the one to use.

    FSDP1 (``FSDPStrategy``) wraps the policy in a root module whose state machine expects every forward and backward
    to run through it; the rollout loop also scores probes, computes old log-probs and exports outside the training
    forward, and crashed in the first backward on a GPU. FSDP2 (``ModelParallelStrategy``) has no such state.
    ``strategy`` is a Lightning strategy, or its name or class path as given in a configuration.
    """
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

    if isinstance(strategy, str):
        name = strategy.rsplit(".", 1)[-1]
        supported = not name.lower().startswith(("fsdp", "deepspeed"))
    else:
        name = type(strategy).__name__
        supported = isinstance(strategy, SingleDeviceStrategy | DDPStrategy | ModelParallelStrategy)
        supported = supported and not isinstance(strategy, DeepSpeedStrategy)
    if not supported:
        raise ValueError(
            f"trainer.strategy {name} is not supported: use lightning.pytorch.strategies.ModelParallelStrategy "
            "(FSDP2: shards each decoder layer, bf16 compute with float32 trainable weights), ddp, or a single device"
        )
