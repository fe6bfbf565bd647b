"""ThroughputMonitor: where an epoch's time goes: weight sync, generation, scoring, training."""

from __future__ import annotations

import time

from lightning import Callback
from typing_extensions import override

from amir_lightning.helpers.tracking import log_metrics


class ThroughputMonitor(Callback):
    """Per epoch: generation and training throughput, sync time, and each phase's share of the epoch.

    Keys: ``throughput/generate_tokens_per_s``, ``throughput/train_tokens_per_s`` (prompt and completion tokens
    through forward and backward), ``throughput/sync_s``, ``throughput/train_s``,
    ``throughput/{sync,generate,score,train}_frac``. With ``data.rollout.max_staleness`` 1 a rollout samples while
    the previous one trains, so its generation is off the critical path: ``throughput/wait_s`` is what the trainer
    waited for it.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._train_s = 0.0
        self._train_tokens = 0.0
        self._rollout = None  # the epoch's rollout, as its steps refer to it

    @override
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._train_s, self._train_tokens, self._rollout = 0.0, 0.0, None

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._rollout = getattr(batch, "rollout", None)
        if self._start is not None and self._rollout is not None:
            self._train_s += time.perf_counter() - self._start
            real = [micro for micro in batch.micro_batches if not micro.filler]
            self._train_tokens += sum(float(micro.attention_mask.sum()) for micro in real)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        rollout = self._rollout
        if rollout is None:  # an epoch resumed after its steps ran: nothing was timed
            return
        timing = rollout.seconds
        phases = {
            "sync": timing["sync_s"],
            "generate": timing["generate_s"],
            "score": timing["score_s"],
            "train": self._train_s,
        }
        total = max(sum(phases.values()), 1e-9)
        logged = {f"throughput/{name}_frac": seconds / total for name, seconds in phases.items()}
        logged["throughput/generate_tokens_per_s"] = rollout.tokens / max(timing["generate_s"], 1e-9)
        logged["throughput/train_tokens_per_s"] = self._train_tokens / max(self._train_s, 1e-9)
        logged["throughput/sync_s"] = timing["sync_s"]
        logged["throughput/train_s"] = self._train_s
        if "wait_s" in timing:
            logged["throughput/wait_s"] = timing["wait_s"]
        log_metrics(trainer, logged)
