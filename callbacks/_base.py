"""Shared plumbing of the step monitors: torchmetrics aggregation over a step's micro-batches."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from lightning import Callback
from torchmetrics import CatMetric, MeanMetric

from amir_lightning.loop.batch import RolloutBatch, RolloutStep
from amir_lightning.objectives import RowDiagnostics


class StepMonitor(Callback):
    """Aggregates per-micro-batch values with torchmetrics (synced across processes) and logs them once per step.

    Subclasses name their keys up front (``means``, ``cats``), call ``self.mean`` and ``self.cat`` for each
    micro-batch of a step in ``on_train_batch_end`` (one call per optimisation step), then log what
    ``self.computed()`` returns. Every process holds every key from the start, so every process syncs the same
    metrics, whether or not it has seen values yet (a process whose step is fillers alone sees none).

    Args:
        means: Keys of (weighted) means.
        cats: Keys of concatenated values (medians, histograms).
    """

    def __init__(self, means: Sequence[str] = (), cats: Sequence[str] = ()) -> None:
        self._means = {key: MeanMetric(nan_strategy="ignore") for key in means}
        self._cats = {key: CatMetric(nan_strategy="ignore") for key in cats}

    def setup(self, trainer, pl_module, stage: str) -> None:  # noqa: D102
        for metric in [*self._means.values(), *self._cats.values()]:
            metric.to(pl_module.device)

    def mean(self, key: str, values: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        """Accumulate a (weighted) mean for ``key``."""
        if values.numel():
            self._means[key].update(values.float(), weight)

    def cat(self, key: str, values: torch.Tensor) -> None:
        """Accumulate raw values for ``key`` (medians, histograms)."""
        if values.numel():
            self._cats[key].update(values.float().flatten())

    def computed(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The step's means and its concatenated values (empty where nothing was seen); then reset.

        Every metric is computed on every process, whether or not this one saw values: computing syncs over
        processes, so skipping it where one process had, say, no correct completion would leave the others waiting
        in a collective that never matches. A mean that no process saw is left out.
        """
        with warnings.catch_warnings():  # "compute called before update" is expected on a process that saw nothing
            warnings.simplefilter("ignore")
            means = {k: m.compute() for k, m in self._means.items()}
            means = {k: v for k, v in means.items() if not v.isnan()}
            computed_cats = {key: metric.compute() for key, metric in self._cats.items()}
        cats = {}
        for key, value in computed_cats.items():
            if isinstance(value, list):
                value = torch.cat(value) if value else torch.zeros(0)
            cats[key] = torch.atleast_1d(value)
        for metric in [*self._means.values(), *self._cats.values()]:
            metric.reset()
        return means, cats


def micro_batches(outputs, step: RolloutStep) -> list[tuple[RolloutBatch, RowDiagnostics]]:
    """Each micro-batch of ``step`` with the loss's per-row diagnostics of it, from ``training_step``'s outputs."""
    rows = outputs.get("rows") if isinstance(outputs, dict) else None
    if not isinstance(step, RolloutStep) or not isinstance(rows, list):
        return []
    return list(zip([m for m in step.micro_batches if not m.filler], rows))
