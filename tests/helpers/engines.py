"""Helpers of the engine tests: an "optimiser step" that moves every weight, and real engines that take pushes wrong.

The faulty engines are the real ``VLLMEngine`` and ``HFEngine`` with one change to ``load_weights``; they generate,
score and read their weights back as the real ones do. Importable by ``amir`` (the tests put this folder on
PYTHONPATH) and selected by ``class_path``.
"""

import torch

from amir_lightning.engines import HFEngine, VLLMEngine, VLLMServerEngine


def perturb(model, scale, seed):
    """An "optimiser step" that moves every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))


class SkipsPushes:
    """An engine that ignores weight pushes (what a silently failing sync looks like) but scores as usual."""

    def __init__(self, engine):
        self.engine = engine

    def load_weights(self, named_tensors, version=0):
        del named_tensors

    def score(self, prompt, completion):
        return self.engine.score(prompt, completion)

    def weight_layout(self):
        return self.engine.weight_layout()

    def held_weights(self, columns):
        return self.engine.held_weights(columns)


class _IgnoresPushesAfter:
    """Takes the first ``good_pushes`` pushes, then ignores every later one (an engine that stopped listening)."""

    def __init__(self, good_pushes: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.good_pushes, self.taken = good_pushes, 0  # not ``pushes``: the server engine counts its own

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        self.taken += 1
        if self.taken <= self.good_pushes:
            super().load_weights(named_tensors, version)


class _DropsHalf:
    """Loads every other pushed tensor and drops the rest (a loader that misses half of the names)."""

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        super().load_weights((t for i, t in enumerate(named_tensors) if i % 2 == 0), version)


class _PartialUpdate:
    """Moves its weights only ``fraction`` of the way from what it holds to what is pushed, at every push."""

    def __init__(self, fraction: float = 0.55, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fraction = fraction
        self.held: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        applied = []
        for name, tensor in named_tensors:
            new = tensor.detach().float()
            old = self.held.get(name, new)
            self.held[name] = old + self.fraction * (new - old)
            applied.append((name, self.held[name].to(tensor.dtype)))
        super().load_weights(applied, version)


class VLLMIgnoresPushesAfter(_IgnoresPushesAfter, VLLMEngine):
    """``VLLMEngine`` that ignores pushes after the ``good_pushes``-th."""


class VLLMDropsHalf(_DropsHalf, VLLMEngine):
    """``VLLMEngine`` that loads every other pushed tensor."""


class VLLMPartialUpdate(_PartialUpdate, VLLMEngine):
    """``VLLMEngine`` that applies ``fraction`` of each update."""


class HFIgnoresPushesAfter(_IgnoresPushesAfter, HFEngine):
    """``HFEngine`` that ignores pushes after the ``good_pushes``-th."""


class HFDropsHalf(_DropsHalf, HFEngine):
    """``HFEngine`` that loads every other pushed tensor."""


class HFPartialUpdate(_PartialUpdate, HFEngine):
    """``HFEngine`` that applies ``fraction`` of each update."""


class RecordsLocalRank(VLLMEngine):
    """``VLLMEngine`` that writes the local rank its vLLM worker got to ``vllm_local_rank.<global rank>``."""

    def start(self, model_dir, seed, device=None, local_rank=0, in_flight=False):  # noqa: D102
        super().start(model_dir, seed, device, local_rank, in_flight)
        from pathlib import Path

        import torch.distributed as dist

        got = self.llm.collective_rpc(_local_rank)[0]
        Path(f"vllm_local_rank.{dist.get_rank()}").write_text(str(got))


def _local_rank(worker):
    return worker.local_rank


class ServerDropsHalf(_DropsHalf, VLLMServerEngine):
    """``VLLMServerEngine`` that sends every other pushed tensor to its server."""


class RecordsSampling(VLLMEngine):
    """``VLLMEngine`` that appends what each generation was asked for to ``sampling.jsonl``: the prompts as text and
    the ``SamplingParams`` vLLM got."""

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        import json

        params = self._params(n, sampling)
        tokenizer = self.llm.get_tokenizer()
        record = {"prompts": [tokenizer.decode(p) for p in prompts]}
        record |= {k: getattr(params, k) for k in ("min_p", "repetition_penalty", "stop", "min_tokens", "temperature")}
        with open("sampling.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
        return super().generate(prompts, n, sampling, seed)


class _Misplaces:
    """Loads every pushed tensor, but ``misplace`` puts some of them in the wrong place (a loader's layout bug)."""

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        super().load_weights(self.misplace(dict(named_tensors)).items(), version)

    def misplace(self, state: dict) -> dict:
        """``state`` with the fault applied."""
        raise NotImplementedError


def _per_head(rows: torch.Tensor, head_dim: int, fn) -> torch.Tensor:
    """``fn`` applied to a projection's rows viewed as ``[heads, head_dim, ...]``."""
    return fn(rows.reshape(-1, head_dim, *rows.shape[1:])).reshape(rows.shape)


def _rotary_interleaved(head: torch.Tensor) -> torch.Tensor:
    """A head's rows in the interleaved rotary order (Meta's) instead of the half-split one (Hugging Face's)."""
    half = head.shape[1] // 2
    return torch.stack([head[:, :half], head[:, half:]], dim=2).reshape(head.shape)


class _HFLayoutFault(_Misplaces):
    def __init__(self, fault: str = "transposed_q", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault = fault

    def misplace(self, state: dict) -> dict:  # noqa: D102
        head_dim = self.model.config.head_dim if getattr(self.model.config, "head_dim", None) else (
            self.model.config.hidden_size // self.model.config.num_attention_heads)  # fmt: skip
        for name, tensor in state.items():
            if self.fault == "transposed_q" and name.endswith("q_proj.weight"):
                state[name] = tensor.T
            elif self.fault == "reversed_heads" and ".q_proj." in name:
                state[name] = _per_head(tensor, head_dim, lambda heads: heads.flip(0))
            elif self.fault == "rotary_interleaved" and (".q_proj." in name or ".k_proj." in name):
                state[name] = _per_head(tensor, head_dim, _rotary_interleaved)
            elif self.fault == "negated_down" and name.endswith("down_proj.weight"):
                state[name] = -tensor
        return state


class HFLayoutFault(_HFLayoutFault, HFEngine):
    """``HFEngine`` that loads one kind of tensor in the wrong layout: ``transposed_q``, ``reversed_heads``,
    ``rotary_interleaved`` or ``negated_down``."""


class _SwapsParts(_Misplaces):
    """Exchanges two same-shaped parts of a fused tensor after ``good_pushes`` correct pushes: ``kv`` (k and v in
    ``qkv_proj``, the same shape under GQA) or ``gate_up`` (gate and up in ``gate_up_proj``)."""

    def __init__(self, parts: str = "kv", good_pushes: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.a, self.b = {"kv": ("k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}[parts]
        self.good_pushes, self.loads = good_pushes, 0  # not ``pushes``: the server engine counts its own

    def misplace(self, state: dict) -> dict:  # noqa: D102
        self.loads += 1
        if self.loads <= self.good_pushes:
            return state
        a, b = f".{self.a}.", f".{self.b}."
        swap = {name: name.replace(a, b) if a in name else name.replace(b, a) for name in state}
        return {swap[name]: tensor for name, tensor in state.items()}


class VLLMSwapsParts(_SwapsParts, VLLMEngine):
    """``VLLMEngine`` that exchanges k and v (or gate and up) inside its fused tensors."""


class ServerSwapsParts(_SwapsParts, VLLMServerEngine):
    """``VLLMServerEngine`` that sends k and v (or gate and up) exchanged after ``good_pushes`` correct pushes."""


class HFForgetsOne(HFEngine):
    """Never loads the pushed tensor ``name`` and never reads it back: its updates never reach the engine. With
    ``in_layout`` the engine still says where it keeps it (a read-back that misses it); without, it says it keeps
    no copy of it."""

    def __init__(self, name: str = "model.norm.weight", in_layout: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.name, self.in_layout = name, in_layout

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        super().load_weights(((n, t) for n, t in named_tensors if n != self.name), version)

    def weight_layout(self):  # noqa: D102
        layout = super().weight_layout()
        if not self.in_layout:
            del layout.dtypes[self.name]
        return layout

    def held_weights(self, columns):  # noqa: D102
        return {key: readings for key, readings in super().held_weights(columns).items() if key != self.name}


class ServerIgnoresPushesAfter(_IgnoresPushesAfter, VLLMServerEngine):
    """``VLLMServerEngine`` that sends its server the first ``good_pushes`` pushes, then none."""


class ServerPartialUpdate(_PartialUpdate, VLLMServerEngine):
    """``VLLMServerEngine`` that moves its server's weights 55 % of the way to each push."""


class ServerReplicaIgnoresPushesAfter(VLLMServerEngine):
    """``VLLMServerEngine`` whose last replica takes the first ``good_pushes`` pushes, then none (the others take
    every one): a replica that stopped listening."""

    def __init__(self, good_pushes: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.good_pushes, self.taken = good_pushes, 0

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        self.taken += 1
        super().load_weights(named_tensors, version)

    def _targets(self):
        return self.replicas if self.taken <= self.good_pushes else self.replicas[:-1]


class ServerLayoutFault(_HFLayoutFault, VLLMServerEngine):
    """``VLLMServerEngine`` that sends its server one kind of tensor in the wrong layout: ``transposed_q``,
    ``reversed_heads``, ``rotary_interleaved`` or ``negated_down`` (the model's configuration read at the start)."""

    def start(self, model_dir, seed, *args, **kwargs):  # noqa: D102
        from types import SimpleNamespace

        from transformers import AutoConfig

        self.model = SimpleNamespace(config=AutoConfig.from_pretrained(model_dir))
        super().start(model_dir, seed, *args, **kwargs)
