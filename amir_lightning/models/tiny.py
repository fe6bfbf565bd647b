"""A tiny Qwen2 policy with a character tokenizer, built from a config (no download), for fast real runs.

The model is random (seeded) and small enough to train from scratch in seconds on a CPU, yet it is a real
Hugging Face model directory that transformers and vLLM both load (vLLM needs head_dim >= 32).
"""

from __future__ import annotations

import json
from pathlib import Path

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


def build_tiny_model(
    directory: str | Path,
    alphabet: str = DEFAULT_ALPHABET,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    seed: int = 0,
    vocab_size: int | None = None,
    dtype: str = "float32",
    head: str = "causal_lm",
) -> Path:
    """Write a random Qwen2 and its character tokenizer to ``directory`` (atomically) and return it.

    ``vocab_size`` beyond the tokenizer's gives a model with a real model's embedding size (ids past the alphabet
    decode to nothing); the weights are initialised on a GPU when there is one. ``head``: ``causal_lm`` (a policy)
    or ``reward`` (a sequence classifier with one output: a reward model, ``RewardModel``).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    if head not in ("causal_lm", "reward"):
        raise ValueError(f"tiny model head must be causal_lm or reward, got {head!r}")

    if hidden_size // num_heads < 32:
        raise ValueError(
            f"tiny model head_dim = hidden_size / num_heads must be >= 32 for vLLM, got {hidden_size} / {num_heads}"
        )
    tokenizer = build_char_tokenizer(alphabet)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"tiny model vocab_size {vocab_size} is smaller than its tokenizer ({len(tokenizer)} tokens)")
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"num_labels": 1} if head == "reward" else {}),
    )
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification
    # A random state of its own: the run's global one (seeded by seed_everything, and drawn from by LoRA's adapter
    # init) must be the same whether this model was built now or found in the cache.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    with atomic_directory(Path(directory), replace=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
        )
    return Path(directory)
