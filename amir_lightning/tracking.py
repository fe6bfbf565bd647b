"""One x-axis for every metric: the optimisation step.

Lightning's ``self.log`` steps by batches under manual optimisation, while rollouts happen per epoch; everything
here (rollout, loss, monitors, evaluation) is written to the logger at ``trainer.global_step`` instead, after the
values have been reduced over processes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def log_metrics(trainer, metrics: Mapping[str, float | torch.Tensor]) -> None:
    """Write scalar ``metrics`` to the trainer's logger at ``trainer.global_step`` (global-zero process only)."""
    if trainer.logger is None or not trainer.is_global_zero or not metrics:
        return
    trainer.logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)
