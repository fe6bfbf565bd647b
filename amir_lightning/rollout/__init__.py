"""Rollouts: engines (vLLM, HF generate), multi-turn episodes, batches of whole groups, scoring, the sync check.

``VLLMEngine`` is importable without vLLM installed; it raises a clear error when started. ``VLLMServerEngine``
talks to a vLLM server over HTTP, so the training process never imports vLLM for it. ``VerifiersEnvironment``
imports verifiers when built.
"""

from amir_lightning.rollout.calculator import CalculatorEnvironment
from amir_lightning.rollout.engine import Completion, RolloutEngine, SamplingConfig
from amir_lightning.rollout.episodes import Environment
from amir_lightning.rollout.hf_engine import HFEngine
from amir_lightning.rollout.replies import ToolError
from amir_lightning.rollout.tools import ToolEnvironment
from amir_lightning.rollout.verifiers_env import VerifiersEnvironment
from amir_lightning.rollout.vllm_engine import VLLMEngine
from amir_lightning.rollout.vllm_server import VLLMServerEngine

__all__ = [
    "CalculatorEnvironment",
    "Completion",
    "Environment",
    "HFEngine",
    "RolloutEngine",
    "SamplingConfig",
    "ToolEnvironment",
    "ToolError",
    "VLLMEngine",
    "VLLMServerEngine",
    "VerifiersEnvironment",
]
