"""A LoRA policy's adapters as an engine takes them at a push, and their exact check after it.

With ``push_adapters`` the engine keeps the base model it was started with (pushed once, whole, and verified like any
push) and takes only the policy's LoRA factors at each later sync: for SmolLM2-135M with r 16 on every linear layer
about 4 % of the merged model's bytes (docs/benchmarks.md). The factors are pushed as a Peft adapter whose ``B`` is
pre-multiplied by the layer's scaling (``alpha / r``) and whose own ``lora_alpha`` equals its rank, so the engine
scales by exactly 1 and computes ``W x + B' (A x)``, the policy's forward. After the load the engine reads back the
factors it computes with, each slice of each fused layer (``q``, ``k``, ``v`` of ``qkv_proj``), and every one must
equal the pushed tensor cast to the engine's dtype, its padding up to the engine's rank zero, and every layer the
policy does not adapt all zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from amir_lightning.engines.digest import WeightLayout

#: Adapter ranks vLLM's ``max_lora_rank`` allows (``vllm.config.lora.MaxLoRARanks``).
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_rank(rank: int) -> int:
    """The smallest rank the engine allows that holds a rank-``rank`` adapter."""
    for allowed in ENGINE_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"model.lora.r {rank}: vLLM serves adapters of rank at most {ENGINE_RANKS[-1]}; set "
        "data.engine.init_args.push_adapters false to push merged weights"
    )


def pushed_rank(push_adapters: bool, lora) -> int | None:
    """The rank of the adapters an engine with ``push_adapters`` takes apart from its base weights.

    ``lora``: the policy's ``LoraSettings``. ``None``: the engine takes merged weights.
    """
    if not push_adapters:
        return None
    if lora is None:
        raise ValueError(
            "data.engine.init_args.push_adapters needs LoRA adapters to push (model.lora); the whole policy "
            "trains, so set it to false"
        )
    engine_rank(lora.r)  # one the engine can serve
    return lora.r


class ServesAdapters:
    """An engine that can serve the policy's LoRA adapters apart from its base weights.

    ``push_adapters`` is its setting, ``take_adapters`` ``RolloutEngine``'s hook, ``lora_rank`` the policy's rank.
    """

    push_adapters: bool = False
    lora_rank: int = 0

    def take_adapters(self, lora) -> None:
        """Serve ``lora``'s adapters apart (``push_adapters``), or take merged weights."""
        rank = pushed_rank(self.push_adapters, lora)
        if rank is not None:
            self.lora_rank, self.takes_adapters = rank, True


def modules_of(adapters: dict[str, torch.Tensor]) -> list[str]:
    """The adapted layers of ``adapters`` (``model.layers.0.self_attn.q_proj``), in push order."""
    prefix = "base_model.model."
    return list(dict.fromkeys(k.removeprefix(prefix).rsplit(".lora_", 1)[0] for k in adapters))


def factors(adapters: dict[str, torch.Tensor], module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``module``'s ``(A [r, in], B' [out, r])`` in ``adapters``."""
    key = f"base_model.model.{module}"
    return adapters[f"{key}.lora_A.weight"], adapters[f"{key}.lora_B.weight"]


def write_adapter(
    folder: Path, adapters: dict[str, torch.Tensor], rank: int, dtype: torch.dtype, alpha: int | None = None
) -> None:
    """``adapters`` as a Peft adapter folder in ``dtype``, with ``lora_alpha`` = ``rank``: scaled by 1 when served.

    ``alpha``: another ``lora_alpha`` (only to show a wrong one is found: the factors are pushed pre-scaled).
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({m.rsplit(".", 1)[-1] for m in modules_of(adapters)})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {name: t.to(dtype).contiguous() for name, t in adapters.items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def adapter_mismatches(
    pushed: dict[str, torch.Tensor],
    held: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
    layout: WeightLayout,
) -> tuple[list[str], int]:
    """The adapted layers whose factors the engine holds otherwise than pushed, and the slices compared.

    ``held``: the engine's LoRA layers by its own names, each slice's ``(A [rank, in], B [out, rank])`` at the
    engine's rank (``VLLMEngine.held_adapters``).
    """
    wrong: list[str] = []
    expected: dict[tuple[str, int], str] = {}
    for module in modules_of(pushed):
        place = layout.adapter_place(module)
        if place is None:
            wrong.append(f"{module} (the engine has no LoRA layer for it)")
        else:
            expected[place] = module
    compared = 0
    for name, slices in held.items():
        for index, (a_held, b_held) in enumerate(slices):
            module = expected.pop((name, index), None)
            if module is None:
                if a_held.any() or b_held.any():
                    wrong.append(f"{name}[{index}] (an adapter the policy does not have)")
                continue
            compared += 1
            a, b = factors(pushed, module)
            if not _holds(a_held, a.to(a_held.dtype), 0) or not _holds(b_held, b.to(b_held.dtype), 1):
                wrong.append(f"{module} (LoRA A or B, held in {name} slice {index})")
    wrong += [f"{module} (not read back from the engine's adapter)" for module in expected.values()]
    return wrong, compared


def _holds(held: torch.Tensor, pushed: torch.Tensor, rank_dim: int) -> bool:
    """``held`` is ``pushed`` padded with zeros along ``rank_dim`` (the engine's rank may exceed the policy's)."""
    rank = pushed.shape[rank_dim]
    if held.dim() != 2 or held.shape[1 - rank_dim] != pushed.shape[1 - rank_dim] or held.shape[rank_dim] < rank:
        return False
    return (
        torch.equal(held.narrow(rank_dim, 0, rank), pushed)
        and not held.narrow(rank_dim, rank, held.shape[rank_dim] - rank).any()
    )
