"""AmirGRPOModule: the policy, its reference, and the GRPO / AMIR-GRPO objective, trained on rollout batches.

    amir fit --config configs/demo.yaml

One forward per micro-batch gives the completion tokens' log-probs; both the policy-gradient term and the pair
term read them (the pair term never re-forwards). Optimisation is manual: a rollout step is a set of micro-batches
of whole groups, and the optimiser steps after the step's last micro-batch, whatever their number.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
from lightning import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from amir_lightning.checkpoints.contents import TrainableCheckpoint
from amir_lightning.evaluation.report import benchmark_report
from amir_lightning.helpers.distributed import all_reduce, sum_shares, world_size
from amir_lightning.helpers.tracking import log_metrics
from amir_lightning.helpers.validation import check_number, raise_errors
from amir_lightning.loop.batch import RolloutBatch, RolloutStep
from amir_lightning.models.export import ExportSettings
from amir_lightning.models.loading import LoraSettings, is_sharded
from amir_lightning.models.policy import Policy, ScoringSettings
from amir_lightning.models.sources import ModelSource
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, LossOutput, StepContext
from amir_lightning.systems.optimisation import BadStepGuard, apply_step, parameter_groups
from amir_lightning.systems.precision import check_strategy, dtype_by_name, take_over_precision
from amir_lightning.systems.summary import planned_steps, run_summary

log = logging.getLogger(__name__)


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW with the small learning rate RL fine-tuning of a pretrained policy wants (1e-6)."""
    return torch.optim.AdamW(params, lr=1e-6)


class AmirGRPOModule(TrainableCheckpoint, LightningModule):
    """Policy, reference and objective.

    Args:
        policy: Where the policy comes from (``HFModel``, ``BundledSmolLM2``, ``TinyModel``).
        loss: The objective, ``AmirGRPOLoss`` (default) or ``GRPOLoss``.
        optimizer: Optimizer factory (default AdamW, lr 1e-6).
        lr_scheduler: Optional LR scheduler factory, stepped once per optimisation step.
        dtype: Dtype of the frozen weights (the LoRA base model, the reference copy); default: the compute dtype
            that ``trainer.precision`` sets (``bfloat16`` for ``bf16-mixed``, else ``float32``) for the LoRA base,
            and for a reference copy the dtype the policy is stored in (so both compute alike at step 0).
        trainable_dtype: Dtype of the trainable weights, hence of their gradients and optimizer state. Keep
            ``float32``: in ``bfloat16`` small updates round away (``amir_lightning.systems.precision``).
        gradient_checkpointing: Recompute activations in the backward pass to save memory.
        lora: Train LoRA adapters instead of all weights; the reference is then the adapter-free model.
        temperature: Temperature of the training log-probs; must equal the sampling temperature (linked in the CLI).
        max_grad_norm: Clip the global gradient norm (``None``: no clipping).
        scoring: How log-probs are computed: chunk size, fused head, packed rows, attention kernels, entropy.
        export: Where and how the trained policy is written: folder, every how many rollouts, merged or adapter.
        max_bad_steps: Stop after this many optimisation steps in a row skipped for a non-finite loss or gradient.

    Attributes:
        model: The ``nn.Module`` that trains (built in ``configure_model``); its weights are the state's ``model.*``.
        policy: The ``Policy`` over it (``amir_lightning/models/policy.py``): tokenizer, scoring, reference, the
            weights to push; the data module's ``policy`` is this one (``RolloutDataModule.attach``).
    """

    def __init__(
        self,
        policy: ModelSource,
        loss: GRPOLoss | None = None,
        optimizer: OptimizerCallable = default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        dtype: str | None = None,
        trainable_dtype: str = "float32",
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        temperature: float = 1.0,
        max_grad_norm: float | None = 1.0,
        scoring: ScoringSettings = ScoringSettings(),  # noqa: B008 (settings are never mutated)
        export: ExportSettings = ExportSettings(),  # noqa: B008
        max_bad_steps: int = 3,
    ) -> None:
        super().__init__()
        ignore = ["policy", "loss", "optimizer", "lr_scheduler", "lora", "scoring", "export"]
        self.save_hyperparameters(ignore=ignore)  # plain values: a checkpoint loads as data
        self.automatic_optimization = False
        self.source, self.loss = policy, loss if loss is not None else AmirGRPOLoss()
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.frozen_dtype = None if dtype is None else dtype_by_name(dtype, "model.dtype")
        self.trainable_dtype = dtype_by_name(trainable_dtype, "model.trainable_dtype")
        self.gradient_checkpointing, self.lora = gradient_checkpointing, lora
        self.compute_dtype = torch.float32  # set from trainer.precision in setup()
        self.temperature, self.max_grad_norm = temperature, max_grad_norm
        self.export_settings = export
        errors: list[str] = []
        check_number(errors, "model.max_grad_norm", max_grad_norm, gt=0, optional=True)
        check_number(errors, "model.temperature", temperature, gt=0)
        check_number(errors, "model.max_bad_steps", max_bad_steps, ge=1)
        if export.format == "adapter" and lora is None:
            errors.append("model.export.format: adapter needs model.lora (the whole policy trains: export merged)")
        raise_errors(errors)
        self.bad_steps = BadStepGuard(max_bad_steps)
        self.model = None  # built in configure_model; its reference lives in the Policy, never checkpointed
        self.policy = Policy(policy, temperature, scoring, lora)  # the policy as the data module sees it
        self.val_accuracy = MeanMetric()
        self.val_environment_reward = MeanMetric()  # where the environment scores its episodes (verifiers)

    # ------------------------------------------------------------------ model
    @override
    def setup(self, stage: str) -> None:
        check_strategy(self.trainer.strategy)
        self.compute_dtype = take_over_precision(self.trainer)
        if getattr(self.loss, "aggregation", None) == "dr_grpo" and self.loss.max_completion_length is None:
            raise ValueError(
                "model.loss.init_args.max_completion_length must be set for aggregation dr_grpo: its constant L, "
                "normally data.sampling.max_new_tokens, times data.environment's max_turns for multi-turn episodes "
                "(amir fit fills it in from there)"
            )

    @override
    def configure_model(self) -> None:
        if self.model is None:  # ModelParallelStrategy sets device_mesh: shard with FSDP2
            mesh, reference = getattr(self, "device_mesh", None), self.loss.needs_reference
            args = self.frozen_dtype, self.trainable_dtype, self.gradient_checkpointing, self.lora, mesh, reference
            self.model = self.policy.build(self.compute_dtype, *args)

    @override
    def on_fit_start(self) -> None:
        if self.policy.reference_copy is not None and not is_sharded(self.policy.reference_copy):
            self.policy.reference_copy.to(self.device)  # a sharded copy lives on its mesh's devices already
        data = getattr(self.trainer, "datamodule", None)
        if self.trainer.is_global_zero and hasattr(data, "settings") and hasattr(data, "prompt_limit"):
            for line in run_summary(self.trainer, self, data):  # the global batch, the length, the memory
                log.warning(line)
            if warning := data.settings.uncorrected_staleness(getattr(self.loss, "sampling_correction", None)):
                log.warning(warning)

    # ------------------------------------------------------------------ training
    def step_context(self, step: RolloutStep) -> StepContext:
        """The context of an optimisation step over all processes (a collective: every process calls it)."""
        reduce = partial(all_reduce, device=self.device)
        return self.loss.step_context(step.lengths, step.rewards, step.group_size, step.truncated, world_size(), reduce)

    def compute_loss(self, batch: RolloutBatch, context: StepContext) -> tuple[LossOutput, torch.Tensor]:
        """The loss of one micro-batch (its share of the step's) and the policy's token log-probs ``[n, T]``.

        The policy's forward with gradient, the reference's without; ``context`` from ``step_context``. With
        ``scoring.entropy`` the stats include ``train/entropy`` (the micro-batch's share of the step's mean over
        the tokens of the policy-gradient term: the policy's own, counted by the step's ``num_tokens``).
        """
        tokens = batch.input_ids, batch.attention_mask, batch.completion_width
        logps, entropy = self.policy.completion_logps(
            self.model, *tokens, self.temperature, self.policy.scoring.entropy
        )
        ref = None
        if self.loss.needs_reference:
            with torch.no_grad(), self.policy.reference() as reference:
                ref = self.policy.completion_logps(reference, *tokens, self.temperature)[0]
        out = self.loss(
            logps,
            batch.completion_mask,
            batch.advantages,
            batch.rewards,
            batch.group_size,
            old_logps=batch.old_logps,
            ref_logps=ref,
            truncated=batch.truncated,
            sampling_logps=batch.sampling_logps,
            context=context,
        )
        if entropy is not None:
            trained = self.loss.trained_tokens(batch.completion_mask, batch.truncated)  # [n, T]
            out.stats["train/entropy"] = (entropy * trained).sum() / max(context.num_tokens, 1.0)
        return out, logps

    def training_step(self, step: RolloutStep, batch_idx: int) -> dict:
        """One optimisation step: the loss of each micro-batch, backward, then the optimiser (skipped if non-finite).

        Returns the step's loss and, for the read-only monitors, each micro-batch's per-row diagnostics.
        """
        if not step.micro_batches:
            return self._empty_step()
        context = self.step_context(step)
        stats: dict[str, torch.Tensor] = {}
        rows, total, bad = [], torch.zeros((), device=self.device), False
        for batch in step.micro_batches:
            # A filler (another process has more micro-batches) runs the same forwards, the reference's included,
            # and a zero backward: FSDP2 gathers the weights in each, and every process must join every gather.
            out, logps = self.compute_loss(batch, context)
            ok = bool(torch.isfinite(out.loss))
            # Data parallelism averages gradients over processes; each process's loss is a share of the global
            # loss. A non-finite loss still runs a zero backward, so processes stay in step; the step is skipped.
            self.manual_backward(out.loss * world_size() if ok and not batch.filler else logps.sum() * 0.0)
            if batch.filler:  # its stats are nothing, but named: every process sums the same keys
                for key in out.stats:
                    stats.setdefault(key, torch.zeros((), device=self.device))
                continue
            bad = bad or not ok
            for key, value in out.stats.items():
                stats[key] = stats.get(key, 0.0) + value.detach().float()
            rows.append(out.rows)
            total = total + out.loss.detach()
        self._optimizer_step(stats, bad)
        return {"loss": total, "rows": rows}

    def _empty_step(self) -> dict:
        """A step that no process has a group for (the rollout trains on fewer groups than it has steps).

        The weights stay as they are, while the step counts: the optimiser steps with no gradient (torch's
        optimisers leave a parameter without one, and its state, untouched) and the LR schedule moves on, so the
        run keeps its planned length and schedule whatever a rollout's groups are.
        """
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        log_metrics(self.trainer, {"train/lr": optimizer.param_groups[0]["lr"]})
        return {"loss": torch.zeros((), device=self.device), "rows": []}

    def _optimizer_step(self, stats: dict[str, torch.Tensor], bad: bool) -> None:
        optimizer, guard, norm = self.optimizers(), self.bad_steps, self.max_grad_norm
        grad_norm = apply_step(self.model, optimizer, self.lr_schedulers(), norm, bad, guard, self.global_step)
        logged = {"train/skipped_steps": self.bad_steps.skipped}
        if grad_norm is not None:  # applied on every process (never a NaN or inf gradient)
            logged |= sum_shares(stats, self.device)  # every stat is its process's share of the step
            logged |= self.loss.end_step(logged)  # AMIR: the lambda this step trained with (the next one is set)
            logged["train/grad_norm"] = grad_norm.detach().float()
            logged["train/lr"] = optimizer.param_groups[0]["lr"]
        log_metrics(self.trainer, logged)

    # ------------------------------------------------------------------ evaluation
    @override
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        correct = batch["correct"].float()  # [prompts, samples]
        self.val_accuracy.update(correct.mean(), weight=correct.numel())
        if "environment_reward" in batch:
            reward = batch["environment_reward"].float()
            self.val_environment_reward.update(reward.mean(), weight=reward.numel())

    @override
    def on_validation_epoch_end(self) -> None:
        if not self.val_accuracy.update_count:
            return
        accuracy = self.val_accuracy.compute()  # synced over processes
        self.val_accuracy.reset()
        logged = {"val/accuracy": accuracy}
        if self.val_environment_reward.update_count:
            logged["val/environment_reward"] = self.val_environment_reward.compute()
            self.val_environment_reward.reset()
        log_metrics(self.trainer, logged)
        self.log("val/accuracy", accuracy, logger=False)  # Lightning's printed table and callbacks

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """One benchmark: unbiased pass@k (``eval/<benchmark>/pass@k``) and ``<log_dir>/eval/<benchmark>.json``."""
        out_dir = Path(self.trainer.log_dir) / "eval" if self.trainer.log_dir else None
        write = self.trainer.is_global_zero
        results = benchmark_report(self.policy, batch, batch["ks"], out_dir if write else None, batch["logps"])
        log_metrics(self.trainer, results)
        self.log_dict(results, logger=False, batch_size=1, sync_dist=True)

    # ------------------------------------------------------------------ optimisation and export
    @override
    def configure_optimizers(self):
        optimizer = self.optimizer_factory(parameter_groups(self.model))  # no weight decay on biases and norms
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if getattr(scheduler, "total_steps", 0) is None:  # WarmupCosineLR follows the run's length
            scheduler.set_total_steps(planned_steps(self.trainer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_train_epoch_end(self) -> None:
        done, root = self.current_epoch + 1, self.export_settings.root(self.trainer.log_dir)
        if self.export_settings.due(done, self.trainer.max_epochs):  # beside the final export, which replaces root
            self.export(root.with_name(f"{root.name}_epoch_{done}"))

    @override
    def on_fit_end(self) -> None:
        target = self.export(self.export_settings.root(self.trainer.log_dir))
        hub = self.export_settings.push_to_hub
        if hub is not None and self.trainer.is_global_zero:
            log.warning("pushed the trained policy to %s", hub.push(target))

    def export(self, target: Path) -> Path:
        """Write the policy and tokenizer to ``target``, atomically, in ``export.format``.

        ``merged``: a Hugging Face model directory with LoRA merged in; ``adapter``: a peft adapter directory.
        Every process must call it (gathering sharded weights is collective); the global-zero process writes.
        """
        write = getattr(self, "_trainer", None) is None or self.trainer.is_global_zero
        self.export_settings.save(self.model, self.policy.tokenizer, Path(target), write)
        if write:
            log.warning("exported the trained policy to %s", target)
        return Path(target)
