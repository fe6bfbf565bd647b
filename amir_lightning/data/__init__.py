"""Prompt sources: JSONL files, Hugging Face datasets, procedural generators; and prompt rendering."""

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.data.files import DataFileError, HFDatasetPrompts, JsonlPrompts
from amir_lightning.data.procedural import ArithmeticPrompts, ReasoningGymPrompts
from amir_lightning.data.templates import THINK_ANSWER_SYSTEM_PROMPT, render_prompt, render_prompts
from amir_lightning.data.verifiers_tasks import VerifiersTasks

__all__ = [
    "THINK_ANSWER_SYSTEM_PROMPT",
    "ArithmeticPrompts",
    "DataFileError",
    "HFDatasetPrompts",
    "JsonlPrompts",
    "Prompt",
    "PromptSource",
    "ReasoningGymPrompts",
    "VerifiersTasks",
    "render_prompt",
    "render_prompts",
]
