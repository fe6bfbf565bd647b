"""Rollout engine on transformers' ``generate``: slow, but needs nothing beyond transformers (parity, no-vLLM hosts).

On-policy by construction: ``generate`` fills every unset option from the model's own ``generation_config`` (a
checkpoint's ``repetition_penalty``, ``no_repeat_ngram_size`` or ``top_k`` would bend the sampling away from the
policy the trainer scores), so the engine replaces that configuration with a neutral one that keeps only the stop
tokens (every EOS id the checkpoint lists, as vLLM stops on), and passes the sampling settings explicitly. The
reported log-probs are those of the distribution actually sampled from (the processed scores).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from typing_extensions import override

from amir_lightning.engines.base import (
    Completion,
    RolloutEngine,
    SamplingConfig,
    check_passed_through,
    seeded,
)
from amir_lightning.engines.digest import ColumnSample, Reading, WeightLayout, WeightSlot, tensor_digest
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.scoring import sequence_token_logps


class HFEngine(RolloutEngine):
    """Sample with ``model.generate`` from the engine's own copy of the policy.

    Args:
        batch_size: Sequences generated together (prompts x samples).
        dtype: Dtype of the engine's copy (``float32``, ``bfloat16``).
        device: Where the copy lives; ``None``: the training process's device (CUDA when available outside a
            trainer).
        progress: Show a progress bar over generation batches (on the global-zero process only).
    """

    def __init__(
        self, batch_size: int = 64, dtype: str = "float32", device: str | None = None, progress: bool = True
    ) -> None:
        errors: list[str] = []
        check_number(errors, "data.engine.init_args.batch_size", batch_size, ge=1)
        raise_errors(errors)
        self.batch_size, self.dtype, self.progress = batch_size, dtype, progress
        self.given_device = device
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = None

    @override
    def start(
        self, model_dir: Path, seed: int, device: torch.device | None = None, local_rank: int = 0, in_flight=False
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if self.given_device is None and device is not None:
            self.device = torch.device(device)  # the training process's own device
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.progress = self.progress and torch.distributed.get_rank() == 0  # one bar, not one per process

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, self.dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        listed = self.model.generation_config.eos_token_id
        listed = listed if isinstance(listed, list) else [listed]
        self.eos_ids = sorted({i for i in [*listed, self.tokenizer.eos_token_id] if i is not None})
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # Nothing of the checkpoint's sampling defaults survives: generate() fills unset options from this one.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        del seed, in_flight  # each generation is seeded with its own seed (``seeded``)
        self._started = True

    @override
    def check_sampling(self, sampling: SamplingConfig) -> None:
        from transformers import GenerationConfig

        if sampling.presence_penalty or sampling.frequency_penalty:
            raise ValueError(
                "data.sampling: HFEngine has no presence_penalty or frequency_penalty (transformers' generate has "
                "none); set them to 0, or use a vLLM engine"
            )
        check_passed_through(sampling, set(GenerationConfig().to_dict()), "transformers' GenerationConfig")

    @override
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingConfig, seed: int | None = None
    ) -> list[list[Completion]]:
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(n)]
        out: list[list[Completion]] = [[] for _ in prompts]
        if sampling.repetition_penalty != 1:
            # transformers' penalty counts the padding as seen tokens: a batch holds prompts of one length only
            rows.sort(key=lambda row: len(row[1]))
        batches = _chunks(rows, self.batch_size, by_length=sampling.repetition_penalty != 1)
        if self.progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc="HF generate", unit="batch", leave=False)
        with seeded(seed):  # sampling draws from torch's RNG, forked and seeded for this generation
            for chunk in batches:
                for (index, _), completion in zip(chunk, self._generate_batch([p for _, p in chunk], sampling)):
                    out[index].append(completion)
        return out

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        pad, eos = self.pad_id, set(self.eos_ids)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            input_ids[row, width - len(p) :] = torch.tensor(p)
            attention[row, width - len(p) :] = 1
        result = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off (the global default would be 50)
            min_p=sampling.min_p or None,
            repetition_penalty=sampling.repetition_penalty,
            max_new_tokens=sampling.max_new_tokens,
            **(sampling.generation_kwargs or {}),
            return_dict_in_generate=True,
            output_scores=True,
        )
        generated = result.sequences[:, width:].cpu()  # [b, T']
        scores = torch.stack(result.scores, dim=1).float()  # [b, T', V] the processed scores that were sampled
        logps = torch.log_softmax(scores, dim=-1)
        picked = logps.gather(-1, generated.to(logps.device).unsqueeze(-1)).squeeze(-1).cpu()  # [b, T']
        completions = []
        for row in range(len(prompts)):
            ids = generated[row].tolist()
            stop = next((t + 1 for t, token in enumerate(ids) if token in eos), None)
            ids = ids[:stop] if stop else ids
            ids, text, stopped = self._cut_at_stop_string(ids, sampling.stop or [])
            reason = "stop" if stop or stopped else "length"
            completions.append(Completion(ids, text, picked[row, : len(ids)].tolist(), reason))
        return completions

    def _cut_at_stop_string(self, ids: list[int], stop: list[str]) -> tuple[list[int], str, bool]:
        """``ids`` up to the token that completes the first stop string, and the text before that string.

        As vLLM does: the tokens that wrote the string stay, the text ends before it. Cutting after sampling gives
        the same completions as stopping would (later tokens never influence earlier ones).
        """
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not any(s in text for s in stop):
            return ids, text, False
        for end in range(1, len(ids) + 1):
            prefix = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
            found = [prefix.find(s) for s in stop if s in prefix]
            if found:
                return ids[:end], prefix[: min(found)], True
        raise AssertionError("unreachable: the whole text holds a stop string")

    @override
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        plan = getattr(named_tensors, "plan", None)  # the names, known before the first tensor (a WeightStream)
        if plan is None:  # any iterable: kept whole, so that a wrong name is found before anything is copied
            named_tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        names = [item[0] for item in (plan if plan is not None else named_tensors)]
        if not names:
            raise ValueError("load_weights got no tensors: the engine would keep stale weights")
        own = self.model.state_dict()
        unknown = sorted(set(names) - set(own))
        if unknown:
            raise KeyError(f"the engine's model has no parameters named {unknown[:5]}")
        for name, tensor in named_tensors:  # a stream is copied as it comes: never the whole model at once
            own[name].copy_(tensor.detach().to(own[name].device, own[name].dtype))

    @override
    def weight_layout(self) -> WeightLayout:
        return _NamedLayout({name: t.dtype for name, t in self.model.state_dict().items()})

    @override
    @torch.no_grad()
    def held_weights(self, columns: ColumnSample) -> dict[str, list[Reading]]:
        del columns  # every tensor is read whole
        return {name: [Reading(tensor_digest(t))] for name, t in self.model.state_dict().items()}

    @override
    @torch.no_grad()
    def score(self, prompt: list[int], completion: list[int]) -> list[float]:
        return sequence_token_logps(self.model, prompt, completion, self.device)


def _chunks(rows: list[tuple[int, list[int]]], size: int, by_length: bool) -> list[list[tuple[int, list[int]]]]:
    """``rows`` in batches of at most ``size``; with ``by_length``, each batch holds prompts of one length."""
    chunks: list[list[tuple[int, list[int]]]] = []
    for row in rows:
        if not chunks or len(chunks[-1]) == size or (by_length and len(chunks[-1][0][1]) != len(row[1])):
            chunks.append([])
        chunks[-1].append(row)
    return chunks


class _NamedLayout(WeightLayout):
    """A copy of the policy under its own names: every pushed tensor lands whole in the tensor of its name."""

    def __init__(self, dtypes: dict[str, torch.dtype]) -> None:
        self.dtypes = dtypes

    @override
    def slot(self, name: str) -> WeightSlot | None:
        dtype = self.dtypes.get(name)
        return None if dtype is None else WeightSlot(name, "", dtype)
