"""AmirCLI: LightningCLI over AmirGRPOModule and RolloutDataModule, with the links and checks a run needs.

The config is read, checked (a bad key, a checkpoint of another model or a trainer value that cannot work is one
line before anything loads), linked (the training temperature is the sampling temperature) and turned into the
trainer, the module and the data module, which ``attach`` joins to the module's policy.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys

from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from amir_lightning import rewards
from amir_lightning.checkpoints.checks import (
    check_base_model,
    check_checkpoint,
    check_compatible,
    renamed_keys,
    saved_checkpoint,
)
from amir_lightning.checkpoints.resume import fit_checkpoints_to_storage, keep_given_model_values, resolve_resume
from amir_lightning.checkpoints.writing import install_atomic_checkpoints
from amir_lightning.environments.tools import ToolEnvironment
from amir_lightning.helpers.messages import close_option_hint, moved_key_hint, user_message
from amir_lightning.helpers.preflight import check_trainer
from amir_lightning.systems.datamodule import RolloutDataModule
from amir_lightning.systems.module import AmirGRPOModule
from amir_lightning.systems.precision import check_precision, check_strategy
from amir_lightning.systems.progress import RunProgressBar

# Every reward class imported (the package imports them on first use): a short class_path in a config
# (``JudgeReward``) resolves among the imported subclasses of ``Reward``.
for _name in rewards.__all__:
    getattr(rewards, _name)

log = logging.getLogger(__name__)

TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,  # one epoch == one rollout
    "use_distributed_sampler": False,  # each rank builds its own shard of whole groups
    "num_sanity_val_steps": 0,
    # Evaluation under no_grad, not inference_mode: metric states reset in one evaluation pass would be inference
    # tensors that the next pass, run under no_grad (as Lightning does whenever a gloo group exists, which an
    # in-process vLLM engine creates), could not update.
    "inference_mode": False,
    "log_every_n_steps": 1,
    "logger": lazy_instance(TensorBoardLogger, save_dir="runs"),
}


def link_completion_length(config) -> None:
    """``dr_grpo``'s constant ``L`` is the policy-token limit of a completion unless given (``max_new_tokens`` a turn).

    ``L`` is ``data.sampling.max_new_tokens``, times the episode's ``max_turns`` for multi-turn episodes: that of
    ``data.environment.init_args``, or ``ToolEnvironment``'s default where ``data.tools`` builds it. Dr. GRPO divides
    every step by the same ``N * L`` (arXiv 2503.20783); without a value the loss would take each step's longest
    completion, a length dependence of its own. The step's tokens are the policy's own (a tool's replies are not
    counted), and each of an episode's turns may write ``max_new_tokens`` of them. An environment without a
    ``max_turns`` argument leaves ``L`` to be given.
    """
    loss = config["model"].get("loss")
    init = loss.get("init_args") if loss is not None and hasattr(loss, "get") else None
    if init is None or init.get("aggregation") != "dr_grpo" or init.get("max_completion_length") is not None:
        return
    environment = config["data"].get("environment")
    if environment is not None:
        turns = (environment.get("init_args") or {}).get("max_turns")
    elif config["data"].get("tools"):  # the shorthand builds ToolEnvironment(tools), its other arguments default
        turns = inspect.signature(ToolEnvironment).parameters["max_turns"].default
    else:
        turns = 1
    if turns is not None:
        init["max_completion_length"] = config["data"]["sampling"]["max_new_tokens"] * turns


class _Parser(LightningArgumentParser):
    """jsonargparse's parser, reporting a bad argument in one line instead of the usage of every option."""

    @override
    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("AMIR_DEBUG") or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        command = " ".join(["amir", *parser.prog.replace(" [options]", "").split()[1:]])
        text = user_message(message) + moved_key_hint(message) + close_option_hint(message, parser)
        sys.stderr.write(f"amir: error: {text}\n(`{command} --help` lists the options)\n")
        raise SystemExit(2)


DESCRIPTION = (
    "AMIR-GRPO post-training of LLMs (arXiv 2601.03661). Subcommands: fit (train), validate (held-out accuracy), "
    "test (pass@k on the benchmarks); and `amir compare RUN_DIR ...` (the analyses of finished runs side by side: "
    "`amir compare --help`)."
)


class AmirCLI(LightningCLI):
    """LightningCLI with the links the rollout loop needs.

    Only the subcommand named on the command line gets its parser built (each start is about 0.1 s quicker, on 2
    cores): ``amir --help`` and a command that names none build them all.
    """

    def __init__(self, *classes, args: ArgsType = None, **kwargs) -> None:
        self.named = named_subcommand(sys.argv[1:] if args is None else args, self.subcommands())
        super().__init__(*classes, args=args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The trainer methods ``amir`` runs: fit, validate and test (Lightning's predict has nothing to predict)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}

    @override
    def _add_subcommands(self, parser, **kwargs) -> None:
        if self.named is None:
            super()._add_subcommands(parser, **kwargs)
            return
        every = self.subcommands()
        self.subcommands = lambda: {self.named: every[self.named]}  # what Lightning's loop reads, for this call
        try:
            super()._add_subcommands(parser, **kwargs)
        finally:
            del self.subcommands

    @override
    def add_arguments_to_parser(self, parser) -> None:
        # The training log-probs must be those of the distribution that was sampled.
        parser.link_arguments("data.sampling.temperature", "model.temperature")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # Save after every rollout (epoch), not only after validation epochs: a killed run loses one rollout at most.
        # last.ckpt links to the rollout's checkpoint: one full write per rollout, not a second copy beside it.
        parser.set_defaults({"checkpoint.save_last": "link", "checkpoint.save_on_train_epoch_end": True})
        parser.add_argument(
            "--validate_before_fit",
            type=bool,
            default=False,
            help="Run validation once before training (held-out accuracy of the initial policy).",
        )

    @override
    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        self.given = copy.deepcopy(self.config)  # before --ckpt_path's saved hyperparameters are laid over it
        subcommand = self.config.get("subcommand")
        if subcommand:  # Lightning reads the checkpoint next: a text file there would raise from torch
            resolve_resume(self.config[subcommand])
            check_checkpoint(self.config[subcommand].get("ckpt_path"))

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config  # run=False: no subcommand
        if config is None:
            return
        fit_checkpoints_to_storage(config)
        if "weights_only" in config and config["weights_only"] is None:
            config["weights_only"] = True  # checkpoints are loaded as data, never as code
        # Before Lightning builds the trainer or reads the checkpoint, so the message is ours and comes first.
        check_trainer(config["trainer"])
        strategy = config["trainer"]["strategy"]
        check_strategy(strategy if isinstance(strategy, str) else strategy.get("class_path", ""))
        check_precision(config["trainer"].get("precision"))
        if self.subcommand:  # no checkpoint without a subcommand
            keep_given_model_values(self.given[self.subcommand]["model"], config)
        link_completion_length(config)
        if config["model"].get("loss") is None:  # a port from TRL or verl expects plain GRPO here
            log.warning("model.loss is not set: training AMIR-GRPO with its pair term (the default, AmirGRPOLoss); "
                        "set model.loss to amir_lightning.objectives.GRPOLoss for plain GRPO")  # fmt: skip

    @override
    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        self.datamodule.attach(self.model.policy)  # the data side's one way to the policy
        path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        saved = saved_checkpoint(path)
        if saved is not None:  # before the engine starts and the weights load: a foreign checkpoint fails in seconds
            check_base_model(saved.get("amir", {}).get("base_model"), self.model.base_model(), path)
            own, optional = self.model.expected_shapes()
            state, renamed = renamed_keys(saved["state_dict"])  # the older names; the load maps them too
            check_compatible(own, state, path, optional)
            if renamed and isinstance(self.trainer.strategy, ModelParallelStrategy):
                raise ValueError(
                    f"checkpoint {path} was written with the older weight names (policy.*, now model.*), which "
                    "ModelParallelStrategy cannot map: it loads a whole checkpoint into the sharded weights before "
                    "the module sees it. Resume it with the earlier version of amir_lightning, or once under DDP or "
                    "one device (their checkpoints then have the new names)"
                )

    @override
    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        install_atomic_checkpoints(trainer)  # a checkpoint is never half-written, whatever kills the run
        bar = trainer.progress_bar_callback
        if type(bar) in (TQDMProgressBar, RichProgressBar):  # Lightning's default: a bar per epoch, here a rollout
            trainer.callbacks[trainer.callbacks.index(bar)] = RunProgressBar(refresh_rate=bar.refresh_rate)
        return trainer

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        finally:
            # The engine ends with the run, however it ends: a vLLM server this process started (and the memory it
            # holds) does not outlive a `main()` called in a notebook or a sweep, where no exit would stop it.
            engine = getattr(self.datamodule, "engine", None)
            try:
                if engine is not None:
                    engine.close()
            except Exception as err:  # what the user must see is how the run ended, not this
                log.warning("closing the rollout engine failed: %s", err)

    def before_fit(self) -> None:  # noqa: D102
        if self.config[self.subcommand].get("validate_before_fit"):
            self.trainer.validate(self.model, datamodule=self.datamodule)


def named_subcommand(args: ArgsType, subcommands: dict) -> str | None:
    """The subcommand ``args`` names (its first word that is one), or ``None`` (none, or ``args`` as a mapping)."""
    if not isinstance(args, list | tuple):
        return None
    return next((word for word in args if isinstance(word, str) and word in subcommands), None)


def build_cli(args: ArgsType = None, run: bool = True) -> AmirCLI:
    """The ``amir`` CLI over ``args``; ``run=False`` builds the module and data module without a subcommand."""
    return AmirCLI(
        AmirGRPOModule,
        RolloutDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_class=_Parser,
        parser_kwargs={"description": DESCRIPTION},
        args=args,
        run=run,
    )
