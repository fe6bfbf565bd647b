"""A tiny Qwen2 policy with a character tokenizer, built from a config (no download), for fast real runs.

The model is random (seeded) and small enough to train from scratch in seconds on a CPU, yet it is a real
Hugging Face model directory that transformers and vLLM both load (vLLM needs head_dim >= 32).
"""

# No ``from __future__ import annotations``: TinySpec's field types stay objects, so that the ``__init__`` the
# dataclass writes for ``TinyModel`` (in sources.py, where these names are not imported) resolves its types.

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from amir_lightning.models.files import atomic_directory

#: Symbols of the default tiny alphabet: enough for arithmetic prompts and answers.
DEFAULT_ALPHABET = "0123456789+-*=?. "
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
# The prompt is the user message (plus an optional system message) and nothing else: every token of a tiny
# sequence is precious, so there are no role markers.
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
#: Every printable ASCII character and the newline: enough for real prompts (GSM8K, chat system prompts).
PRINTABLE_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
#: The transformer shape of Qwen2.5-3B-Instruct (the paper's main model), for random models of its size.
QWEN25_3B_SHAPE = dict(
    hidden_size=2048,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    intermediate_size=11008,
    vocab_size=151936,
    max_position_embeddings=32768,
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet`` plus pad/eos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"tiny tokenizer alphabet has repeated characters: {alphabet!r}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class TinySpec:
    """What a tiny model is built from: its tokenizer's alphabet, its transformer's shape, seed, dtype and head.

    Attributes:
        alphabet: Characters of the tokenizer (plus pad, eos, unk).
        hidden_size: Model width (``hidden_size / num_heads >= 32`` for vLLM).
        num_layers: Transformer layers.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence.
        seed: Initialisation seed.
        vocab_size: Model vocabulary (default: the tokenizer's); larger gives a real model's embedding size (ids past
            the alphabet decode to nothing).
        dtype: Dtype the weights are saved in.
        head: ``causal_lm`` (a policy) or ``reward`` (a sequence classifier with one output: a reward model,
            ``RewardModel``).
    """

    alphabet: str = DEFAULT_ALPHABET
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 128
    max_position_embeddings: int = 256
    seed: int = 0
    vocab_size: int | None = None
    dtype: str = "float32"
    head: Literal["causal_lm", "reward"] = "causal_lm"

    def build(self, directory: str | Path) -> Path:
        """Write the random Qwen2 and its character tokenizer to ``directory`` (atomically) and return it.

        The weights are initialised on a GPU when there is one.
        """
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

        if self.head not in ("causal_lm", "reward"):
            raise ValueError(f"tiny model head must be causal_lm or reward, got {self.head!r}")
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                "tiny model head_dim = hidden_size / num_heads must be >= 32 for vLLM, "
                f"got {self.hidden_size} / {self.num_heads}"
            )
        tokenizer = build_char_tokenizer(self.alphabet)
        if self.vocab_size is not None and self.vocab_size < len(tokenizer):
            raise ValueError(
                f"tiny model vocab_size {self.vocab_size} is smaller than its tokenizer ({len(tokenizer)} tokens)"
            )
        config = Qwen2Config(
            vocab_size=self.vocab_size or len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **({"num_labels": 1} if self.head == "reward" else {}),
        )
        auto = AutoModelForCausalLM if self.head == "causal_lm" else AutoModelForSequenceClassification
        # A random state of its own: the run's global one (seeded by seed_everything, and drawn from by LoRA's adapter
        # init) must be the same whether this model was built now or found in the cache.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            torch.manual_seed(self.seed)
            model = auto.from_config(config, dtype=getattr(torch, self.dtype))
        with atomic_directory(Path(directory), replace=False) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "generation_config.json").write_text(
                json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
            )
        return Path(directory)


def build_tiny_model(directory: str | Path, **spec: Any) -> Path:
    """Write a random Qwen2 and its character tokenizer to ``directory`` (atomically) and return it.

    Args:
        directory: Where the model directory goes.
        **spec: ``TinySpec``'s fields by name (``alphabet``, ``hidden_size``, ``seed``, ``head``, ...).
    """
    return TinySpec(**spec).build(directory)
