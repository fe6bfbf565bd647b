"""Rollouts: engines (vLLM, HF generate), batches of whole groups, reward scoring and the weight-sync check.

``VLLMEngine`` is importable without vLLM installed; it raises a clear error when started.
"""

from amir_lightning.rollout.engine import Completion, RolloutEngine, SamplingConfig
from amir_lightning.rollout.hf_engine import HFEngine
from amir_lightning.rollout.vllm_engine import VLLMEngine

__all__ = ["Completion", "HFEngine", "RolloutEngine", "SamplingConfig", "VLLMEngine"]
