"""Rollouts: engines (vLLM, HF generate), the rollout data module and its batch types.

``VLLMEngine`` is importable without vLLM installed; it raises a clear error when started.
"""

from amir_lightning.rollout.engine import Completion, RolloutEngine, SamplingConfig
from amir_lightning.rollout.hf_engine import HFEngine
from amir_lightning.rollout.vllm_engine import VLLMEngine

__all__ = ["Completion", "HFEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine"]
