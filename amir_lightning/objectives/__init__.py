"""Pure tensor objectives: advantages, log-probs, pair mining, GRPO and AMIR-GRPO losses. No models here."""

from amir_lightning.objectives.advantages import group_advantages
from amir_lightning.objectives.amir import AmirGRPOLoss, LambdaSchedule
from amir_lightning.objectives.base import LossOutput, RowDiagnostics, StepContext
from amir_lightning.objectives.grpo import GRPOLoss
from amir_lightning.objectives.logprobs import (
    chosen_token_logps,
    selective_log_softmax,
    sequence_logps,
    token_entropy,
)
from amir_lightning.objectives.pairs import MinedGroups, PairRule, mine_pairs
from amir_lightning.objectives.preference import pair_logits, preference_loss

__all__ = [
    "AmirGRPOLoss",
    "GRPOLoss",
    "LambdaSchedule",
    "LossOutput",
    "MinedGroups",
    "PairRule",
    "RowDiagnostics",
    "StepContext",
    "chosen_token_logps",
    "group_advantages",
    "mine_pairs",
    "pair_logits",
    "preference_loss",
    "selective_log_softmax",
    "sequence_logps",
    "token_entropy",
]
