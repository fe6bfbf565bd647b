"""Rewards: math answer correctness (sandboxed math-verify) and format rewards, composed as a weighted sum."""

from amir_lightning.rewards.base import Reward
from amir_lightning.rewards.format import AnswerNumberReward, TagCountReward, ThinkAnswerFormatReward
from amir_lightning.rewards.math import MathAnswerReward
from amir_lightning.rewards.sandbox import SandboxedGrader

__all__ = [
    "AnswerNumberReward",
    "MathAnswerReward",
    "Reward",
    "SandboxedGrader",
    "TagCountReward",
    "ThinkAnswerFormatReward",
]
