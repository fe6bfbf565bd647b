"""Activation memory of one qwen.yaml micro-batch, with and without gradient checkpointing, counted by autograd.

    python benchmarks/activation_memory.py [--tokens-per-row 160 320] [--layers 1 2]

The qwen.yaml step (Qwen2.5-3B's shape, LoRA r 16 on every linear layer over a bf16 base, float32 adapters, bf16
autocast) on micro-batches of one group: 8 rows of a 160-token prompt and a completion (128-512 tokens in the
paper's setting). What the backward needs is counted as it is saved (``torch.autograd.graph.saved_tensors_hooks``):
every saved tensor's storage once, the model's own weights excluded (they are resident anyway). Random models of 1
and 2 decoder layers give the cost of one layer (the difference) and of the rest (embedding, final norm); the table
extrapolates to Qwen2.5-3B's 36 layers. The LM head and log-softmax are left out: the fused head keeps only ``[N, T]``
values (benchmarks/logprob_memory.py).

With gradient checkpointing the forward saves each layer's input only, and the backward recomputes one layer at a
time: the peak is the saved inputs plus one layer's activations. Without it every layer's activations stay until
the backward reaches them. The weights, adapters and AdamW state add the same to both (``--layers`` 36 on a GPU
measures them: benchmarks/step_time.py --paper-shape prints the peak allocated memory).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from _common import machine

from amir_lightning.models import QWEN25_3B_SHAPE, LoraSettings, build_tiny_model
from amir_lightning.models.loading import load_policy

GIB = 2**30


def saved_bytes(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward of ``model``'s decoder on the batch."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = (
            model.get_base_model()
            .model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            .last_hidden_state
        )
    del hidden
    return sum(storages.values())


def measure(layers: int, checkpointing: bool, rows: int, width: int, directory: Path) -> int:
    shape = dict(QWEN25_3B_SHAPE, num_layers=layers, vocab_size=1024, dtype="bfloat16")  # the head is not counted
    model_dir = build_tiny_model(directory / f"l{layers}", seed=0, **shape)
    lora = LoraSettings(r=16, alpha=16, target_modules="all-linear")
    model = load_policy(model_dir, torch.bfloat16, torch.float32, checkpointing, lora)
    model.train()
    ids = torch.randint(0, 1000, (rows, width), generator=torch.Generator().manual_seed(0))
    return saved_bytes(model, ids, torch.ones_like(ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="rows of a micro-batch (one group)")
    parser.add_argument("--prompt", type=int, default=160)
    parser.add_argument("--completions", type=int, nargs="+", default=[128, 320, 512], help="completion widths")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = QWEN25_3B_SHAPE["num_layers"]
    print(
        f"saved-for-backward memory of one micro-batch ({args.rows} rows), Qwen2.5-3B shape, LoRA r16 all-linear, "
        f"bf16 autocast, extrapolated from 1 and 2 layers to {layers}; {machine()}"
    )
    print("| completion width | tokens | per layer MiB | no checkpointing GiB | checkpointing GiB | saved by it GiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for completion in args.completions:
            width = args.prompt + completion
            full = [measure(n, False, args.rows, width, Path(tmp)) for n in (1, 2)]
            ckpt = [measure(n, True, args.rows, width, Path(tmp)) for n in (1, 2)]
            layer, rest = full[1] - full[0], 2 * full[0] - full[1]
            ckpt_layer, ckpt_rest = ckpt[1] - ckpt[0], 2 * ckpt[0] - ckpt[1]
            without = rest + layers * layer
            with_ckpt = ckpt_rest + layers * ckpt_layer + layer  # + one layer recomputed in the backward
            print(
                f"| {completion} | {args.rows * width} | {layer / 2**20:.0f} | {without / GIB:.1f} | "
                f"{with_ckpt / GIB:.1f} | {(without - with_ckpt) / GIB:.1f} |"
            )


if __name__ == "__main__":
    main()
