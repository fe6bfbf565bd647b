"""Every configured logger gets every metric, at one x-axis: the optimisation step.

Lightning's ``self.log`` steps by batches under manual optimisation, while rollouts happen per epoch; everything
here (rollout, loss, monitors, evaluation) is written at ``trainer.global_step`` instead, after the values have been
reduced over processes, from the global-zero process. Scalars also land in ``trainer.callback_metrics`` on every
process, so Lightning's ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` can watch ``rollout/reward_mean``.

- Scalars go to every logger of ``trainer.loggers`` (TensorBoard, CSV, W&B, MLflow, ...).
- Histograms go to loggers that draw them: TensorBoard (``add_histogram``) and W&B (``wandb.Histogram``).
- Sample tables go to TensorBoard as markdown text and to W&B as a table; CSV and others take scalars only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _loggers(trainer) -> list:
    if not trainer.is_global_zero:
        return []
    return list(getattr(trainer, "loggers", None) or [])


def _is_wandb(logger) -> bool:
    return type(logger).__name__ == "WandbLogger"


def log_metrics(trainer, metrics: Mapping[str, float | torch.Tensor]) -> None:
    """Write scalar ``metrics`` to every logger at ``trainer.global_step``, and into ``trainer.callback_metrics``.

    ``callback_metrics`` is what ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` read; every process gets the
    values there (they are reduced over processes already), so all of them agree on saving and stopping.
    """
    if not metrics:
        return
    values = {k: float(v) for k, v in metrics.items()}
    monitored = getattr(trainer, "callback_metrics", None)
    if isinstance(monitored, dict):
        monitored.update({k: torch.tensor(v) for k, v in values.items()})
    for logger in _loggers(trainer):
        logger.log_metrics(values, step=trainer.global_step)


def log_histogram(trainer, tag: str, values: torch.Tensor) -> None:
    """A histogram of ``values`` in the loggers that draw histograms (TensorBoard, W&B)."""
    if not values.numel():
        return
    values = values.detach().float().cpu()
    for logger in _loggers(trainer):
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_histogram"):
            experiment.add_histogram(tag, values, trainer.global_step)
        elif _is_wandb(logger):
            import wandb

            logger.log_metrics({tag: wandb.Histogram(values.numpy())}, step=trainer.global_step)


def log_table(trainer, tag: str, columns: Sequence[str], rows: Sequence[Sequence], markdown: str) -> None:
    """A table of samples: markdown text in TensorBoard, a table in W&B; other loggers are skipped."""
    for logger in _loggers(trainer):
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text(tag, markdown, trainer.global_step)
        elif _is_wandb(logger):
            logger.log_table(tag, columns=list(columns), data=[list(r) for r in rows], step=trainer.global_step)
