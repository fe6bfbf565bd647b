"""Policies: Hugging Face ids or paths, the bundled offline SmolLM2, and tiny models built from a config."""

from amir_lightning.models.loading import LoraSettings, load_policy, load_reference, merged_state
from amir_lightning.models.sources import BundledSmolLM2, HFModel, ModelSource, TinyModel
from amir_lightning.models.tiny import (
    PRINTABLE_ALPHABET,
    QWEN25_3B_SHAPE,
    TinySpec,
    build_char_tokenizer,
    build_tiny_model,
)

__all__ = [
    "PRINTABLE_ALPHABET",
    "QWEN25_3B_SHAPE",
    "BundledSmolLM2",
    "HFModel",
    "LoraSettings",
    "ModelSource",
    "TinyModel",
    "TinySpec",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_policy",
    "load_reference",
    "merged_state",
]
