"""A tiny Qwen2 policy with a character tokenizer, built from a config (no download), for fast real runs.

The model is random (seeded) and small enough to train from scratch in seconds on a CPU, yet it is a real
Hugging Face model directory that transformers and vLLM both load (vLLM needs head_dim >= 32: design.md 5).
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
) -> Path:
    """Write a random tiny Qwen2 and its character tokenizer to ``directory`` (atomically) and return it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if hidden_size // num_heads < 32:
        raise ValueError(
            f"tiny model head_dim = hidden_size / num_heads must be >= 32 for vLLM, got {hidden_size} / {num_heads}"
        )
    tokenizer = build_char_tokenizer(alphabet)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
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
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with atomic_directory(Path(directory), replace=False) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
        )
    return Path(directory)
