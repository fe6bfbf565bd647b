"""Rewards: math grading, format rewards, reward models, LLM judges and plain functions (TRL's signature)."""

from amir_lightning.rewards.base import FunctionReward, Reward
from amir_lightning.rewards.environment import EnvironmentReward
from amir_lightning.rewards.format import (
    AnswerNumberReward,
    TagCountReward,
    ThinkAnswerFormatReward,
    ToolUseReward,
)
from amir_lightning.rewards.inputs import RewardInputs, RunState
from amir_lightning.rewards.judge import JudgeReward, JudgeServer
from amir_lightning.rewards.length import LengthControlledAnswerReward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rewards.model import RewardModel
from amir_lightning.rewards.overlong import OverlongPenalty
from amir_lightning.rewards.sandbox import SandboxedGrader

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
