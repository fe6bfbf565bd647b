"""Rewards: math grading, format rewards, reward models, LLM judges and plain functions (TRL's signature).

The names below are imported on first use (PEP 562): a grading worker (``rewards/sandbox.py``) imports
``rewards.grading`` alone, without torch, and starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: Each exported name and the module that defines it.
_WHERE = {
    "AnswerNumberReward": "format",
    "EnvironmentReward": "environment",
    "FunctionReward": "base",
    "JudgeReward": "judge",
    "JudgeServer": "judge",
    "LengthControlledAnswerReward": "length",
    "MathAnswerReward": "math",
    "OverlongPenalty": "overlong",
    "Reward": "base",
    "RewardInputs": "inputs",
    "RewardModel": "model",
    "RunState": "inputs",
    "SandboxedGrader": "sandbox",
    "TagCountReward": "format",
    "ThinkAnswerFormatReward": "format",
    "ToolUseReward": "format",
}
__all__ = [
    "AnswerNumberReward",
    "EnvironmentReward",
    "FunctionReward",
    "JudgeReward",
    "JudgeServer",
    "LengthControlledAnswerReward",
    "MathAnswerReward",
    "OverlongPenalty",
    "Reward",
    "RewardInputs",
    "RewardModel",
    "RunState",
    "SandboxedGrader",
    "TagCountReward",
    "ThinkAnswerFormatReward",
    "ToolUseReward",
]

if TYPE_CHECKING:
    from amir_lightning.rewards.base import FunctionReward, Reward
    from amir_lightning.rewards.environment import EnvironmentReward
    from amir_lightning.rewards.format import AnswerNumberReward, TagCountReward, ThinkAnswerFormatReward, ToolUseReward
    from amir_lightning.rewards.inputs import RewardInputs, RunState
    from amir_lightning.rewards.judge import JudgeReward, JudgeServer
    from amir_lightning.rewards.length import LengthControlledAnswerReward
    from amir_lightning.rewards.math import MathAnswerReward
    from amir_lightning.rewards.model import RewardModel
    from amir_lightning.rewards.overlong import OverlongPenalty
    from amir_lightning.rewards.sandbox import SandboxedGrader


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
