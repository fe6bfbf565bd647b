"""A reward model: a sequence classifier with one output scores the prompt and the completion as a conversation.

    rewards:
      - class_path: amir_lightning.rewards.RewardModel
        init_args: {model: Skywork/Skywork-Reward-V2-Qwen3-0.6B, batch_size: 16}

The conversation is the prompt's messages (its own, or the question as the user's message) and the completion as the
assistant's answer, written with the reward model's own chat template (the one it was trained with), or as the
texts one per line when it has none. Sequences are scored in batches, left-padded, with position ids that skip the
padding, so a batch gives the scores each sequence gets alone; the score is the classifier's output at the last
token. The model loads at the first rollout, on the training process's device (each process scores its own
completions), and is frozen; its config is checked before (``setup``): a model that is not a sequence classifier
with one output (a causal LM: its score head would be random) stops the run in one line. A tokenizer without a pad
token is fine (the padding's id is never read), and ``max_length`` is held to the model's context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from typing_extensions import override

from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.models.sources import HFModel, ModelSource
from amir_lightning.rewards.base import Reward

log = logging.getLogger(__name__)


class RewardModel(Reward):
    """Score completions with a sequence-classification reward model (``AutoModelForSequenceClassification``).

    Args:
        model: A Hugging Face id or directory, or a model source (``HFModel`` with a revision,
            ``TinyModel`` with ``head: reward`` for tests).
        batch_size: Sequences scored together.
        max_length: Longest sequence in tokens; a longer one keeps its end (where the score is read) and is
            counted in a warning.
        device: Where the model runs; ``None``: the training process's device (its current CUDA device, else CPU).
        dtype: ``auto`` (``bfloat16`` on CUDA, ``float32`` on CPU), ``float32`` or ``bfloat16``.
        weight: Multiplier in the total reward.
        name: Metric name (default ``reward_model``: ``rollout/reward/reward_model``).
    """

    def __init__(
        self,
        model: str | ModelSource,
        batch_size: int = 16,
        max_length: int = 4096,
        device: str | None = None,
        dtype: str = "auto",
        weight: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        errors: list[str] = []
        check_number(errors, f"data.rewards: {self.name}.batch_size", batch_size, ge=1)
        check_number(errors, f"data.rewards: {self.name}.max_length", max_length, ge=2)
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            errors.append(f"data.rewards: {self.name}.dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        raise_errors(errors)
        self.source = HFModel(model) if isinstance(model, str) else model
        self.batch_size, self.max_length, self.device, self.dtype = batch_size, max_length, device, dtype
        self.model = self.tokenizer = None

    def setup(self) -> None:
        """Before the first rollout: refuse a model whose config is not a reward model's (its kind, its outputs)."""
        from transformers import AutoConfig

        path = self._path()
        config = AutoConfig.from_pretrained(path)
        kinds = getattr(config, "architectures", None) or []
        if kinds and not any(kind.endswith("ForSequenceClassification") for kind in kinds):
            raise ValueError(f"data.rewards: {self.name}.model {path} is not a sequence-classification model (it is "
                             f"{', '.join(kinds)}): its score head would be random weights")  # fmt: skip
        _check_labels(config.num_labels, path, f"data.rewards: {self.name}.model")

    def _path(self):
        try:
            return self.source.resolve()
        except FileNotFoundError as err:
            raise FileNotFoundError(
                str(err).replace("model.policy.init_args.name_or_path", f"data.rewards: {self.name}.model")
            ) from None

    def load(self) -> None:
        """Load the model and its tokenizer (the first ``score`` does)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        key, path = f"data.rewards: {self.name}.model", self._path()
        here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        device = torch.device(self.device or here)
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model, info = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype), output_loading_info=True
        )
        _check_head(self.model, info, path, key)
        # The score is read at the last column of left-padded rows; no id is padding to transformers' pooling, and
        # the padding's id is never read (masked out): any id of the vocabulary pads.
        self.model.config.pad_token_id = -1
        self.model.to(device).eval().requires_grad_(False)
        pad, rows = self.tokenizer.pad_token_id, self.model.get_input_embeddings().num_embeddings
        # A tokenizer without a pad token may give one past the model's vocabulary (an IndexError in the embedding)
        self.pad_id = pad if pad is not None and 0 <= pad < rows else 0
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and context < self.max_length:
            log.info("%s: max_length %d is over the model's context (max_position_embeddings %d): sequences keep "
                     "their last %d tokens", self.name, self.max_length, context, context)  # fmt: skip
            self.max_length = context

    def text(self, prompt: str | list[dict], completion: str) -> str:
        """The conversation the model scores, as text: ``prompt`` is the question or the prompt's messages."""
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages.append({"role": "assistant", "content": completion})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "".join(m["content"] + "\n" for m in messages)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, its end kept where it is over ``max_length``."""
        with_template = bool(getattr(self.tokenizer, "chat_template", None))  # the template writes its own BOS
        ids = [self.tokenizer(t, add_special_tokens=not with_template)["input_ids"] for t in texts]
        cut = sum(len(row) > self.max_length for row in ids)
        if cut:
            log.warning("%s: %d of %d sequences are over max_length %d tokens; their ends were scored",
                        self.name, cut, len(ids), self.max_length)  # fmt: skip
        return [row[-self.max_length :] for row in ids]

    @torch.no_grad()
    def scores(self, rows: list[list[int]]) -> list[float]:
        """The model's output at the last token of each row, in batches of ``batch_size``."""
        device = next(self.model.parameters()).device
        out: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            width = max(len(r) for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding: every row ends at the last column
                ids[i, width - len(r) :] = torch.tensor(r)
                mask[i, width - len(r) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as if each row were alone
            logits = self.model(
                input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device)
            ).logits  # [b, 1]
            out += logits[:, 0].float().cpu().tolist()
        return out

    def score(self, completions: Sequence[str], answers: Sequence[str], **kwargs) -> list[float]:
        """The reward model's score of each (prompt, completion) conversation (``kwargs["prompts"]``: TRL's)."""
        if self.model is None:
            self.load()
        return self.scores(self.encode([self.text(p, c) for p, c in zip(kwargs["prompts"], completions)]))

    @override
    def close(self) -> None:
        self.model = None


def _check_head(model, info: dict, path, key: str) -> None:
    """Refuse a model whose score head did not load from its files (it would score at random) or has several labels."""
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith(model.base_model_prefix + ".")]
    if missing:
        kinds = ", ".join(getattr(model.config, "architectures", None) or ["a model of another kind"])
        raise ValueError(
            f"{key} {path} is not a sequence-classification model: its files have no score head ({missing[0]} "
            f"missing; it is {kinds}), so every score would come from random weights"
        )
    _check_labels(model.config.num_labels, path, key)


def _check_labels(labels: int, path, key: str) -> None:
    if labels != 1:
        raise ValueError(
            f"{key} {path} has {labels} outputs (num_labels): a reward model has one; a classifier with several "
            "labels is not a reward model"
        )
