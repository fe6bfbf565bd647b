"""``attn_implementation: varlen``: packed sequences through PyTorch's variable-length flash attention.

With ``model.scoring.packing`` a micro-batch is one row of every real token, position ids restarting at each
sequence. SDPA and eager attend through a block-diagonal mask over the whole row; flash attention (the
``flash-attn`` package) runs each sequence alone. ``varlen`` does the latter with the kernel that ships in PyTorch
(``torch.nn.attention.varlen.varlen_attn``, CUDA, half precision), so packing needs no extra package. Anything the
kernel does not take (a padded batch of several rows, a KV cache, float32, a CPU, dropout, a sliding window) goes
to transformers' SDPA function, with SDPA's mask: ``varlen`` is SDPA wherever it is not a packed row on a GPU.
"""

from __future__ import annotations

import inspect

import torch

NAME = "varlen"


def packed_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[S + 1]`` int32 offsets of the sequences of one packed row (where the position ids restart at 0)."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).flatten()
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, end]).to(torch.int32)


def _takes(query, key, attention_mask, dropout, sliding_window) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2]  # no KV cache: every key is a query of this forward
        and not dropout
        and sliding_window is None
        and (attention_mask is None or attention_mask.dim() == 4)  # None or the mask of a packed row, not padding
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention interface: ``query`` ``[1, H, L, D]``, keys and values ``[1, H_kv, L, D]``.

    Returns ``[1, L, H, D]`` (and no weights), causal within each sequence of the packed row. The sequences are
    ``cu_seq_lens_q`` / ``max_length_q`` where the caller passes them (``completion_logps``, once per forward),
    else where the position ids restart at 0.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    offsets, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    position_ids = kwargs.get("position_ids")
    packed = offsets is not None or (position_ids is not None and position_ids.reshape(-1)[0] == 0)
    if not (packed and _takes(query, key, attention_mask, dropout, sliding_window)):
        extra = {} if sliding_window is None else {"sliding_window": sliding_window}
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra, **kwargs
        )
    from torch.nn.attention.varlen import varlen_attn

    if offsets is None:
        offsets = packed_starts(position_ids)
        longest = int((offsets[1:] - offsets[:-1]).max())
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D]
    gqa = q.shape[1] != k.shape[1]
    options = _kernel_options(varlen_attn, scaling, q.shape[-1], gqa)
    if gqa and "enable_gqa" not in options:  # older kernels: one key head per query head
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **options)[None], None


def _kernel_options(kernel, scaling: float | None, head_dim: int, gqa: bool) -> dict:
    """Causal attention with ``scaling``, in the keywords this torch's ``varlen_attn`` takes.

    They changed across releases: ``is_causal`` before ``window_size``, no ``scale`` or ``enable_gqa`` at first.
    """
    params = inspect.signature(kernel).parameters
    options: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if gqa and "enable_gqa" in params:
        options["enable_gqa"] = True
    if "scale" in params:
        options["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale; the model needs {scaling} (use sdpa)")
    return options


def register() -> None:
    """Make ``varlen`` a transformers attention implementation (and SDPA's mask its mask); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
