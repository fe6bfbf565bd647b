"""The Lightning systems and what only they use.

``AmirGRPOModule`` holds the policy, its reference and the objective; ``RolloutDataModule`` collects rollouts from
the engine, scored by the rewards. Beside them: precision, the LR schedule, the start-up summary, the progress bar.
"""

from amir_lightning.systems.datamodule import RolloutDataModule
from amir_lightning.systems.module import AmirGRPOModule
from amir_lightning.systems.schedules import WarmupCosineLR

__all__ = ["AmirGRPOModule", "RolloutDataModule", "WarmupCosineLR"]
