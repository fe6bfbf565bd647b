"""The ``amir`` command: LightningCLI over AmirGRPOModule and RolloutDataModule.

amir fit --config configs/demo.yaml
amir validate --config configs/demo.yaml
amir fit --config configs/qwen.yaml --model.loss amir_lightning.objectives.GRPOLoss
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import warnings

from jsonargparse import lazy_instance
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from amir_lightning.checkpoints.checks import check_base_model, check_checkpoint, check_compatible, saved_checkpoint
from amir_lightning.checkpoints.resume import fit_checkpoints_to_storage, keep_given_model_values, resolve_resume
from amir_lightning.checkpoints.writing import CheckpointWriteError, install_atomic_checkpoints
from amir_lightning.helpers.console import PipeSafeStdout, quiet_second_interrupt, user_traceback
from amir_lightning.helpers.messages import close_option_hint, moved_key_hint, user_message
from amir_lightning.helpers.preflight import check_config_files, check_trainer
from amir_lightning.rewards.base import RewardError
from amir_lightning.rollout.sync import StaleEngineError
from amir_lightning.systems.datamodule import RolloutDataModule
from amir_lightning.systems.module import AmirGRPOModule
from amir_lightning.systems.precision import check_strategy
from amir_lightning.systems.progress import RunProgressBar

log = logging.getLogger(__name__)

TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,  # one epoch == one rollout
    "use_distributed_sampler": False,  # each rank builds its own shard of whole groups
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "logger": lazy_instance(TensorBoardLogger, save_dir="runs"),
}


#: Exceptions that mean "the input is wrong" (configuration, data files, paths, missing extras, a stale engine).
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    ModuleNotFoundError,
    StaleEngineError,
    CheckpointWriteError,  # the disk, named with the path and the space needed
    MisconfigurationException,  # Lightning's word for a bad trainer argument
)


def link_completion_length(config) -> None:
    """``dr_grpo``'s constant ``L`` is the completion length limit, ``data.sampling.max_new_tokens``, unless given.

    Dr. GRPO divides every step by the same ``N * L`` (arXiv 2503.20783); without a value the loss would take each
    step's longest completion, a length dependence of its own.
    """
    loss = config["model"].get("loss")
    init = loss.get("init_args") if loss is not None and hasattr(loss, "get") else None
    if init is None or init.get("aggregation") != "dr_grpo" or init.get("max_completion_length") is not None:
        return
    init["max_completion_length"] = config["data"]["sampling"]["max_new_tokens"]


class _Parser(LightningArgumentParser):
    """jsonargparse's parser, reporting a bad argument in one line instead of the usage of every option."""

    def error(self, message: str, ex: Exception | None = None):  # noqa: D102
        if not self.exit_on_error or os.environ.get("AMIR_DEBUG") or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        command = " ".join(["amir", *parser.prog.replace(" [options]", "").split()[1:]])
        text = user_message(message) + moved_key_hint(message) + close_option_hint(message, parser)
        sys.stderr.write(f"amir: error: {text}\n(`{command} --help` lists the options)\n")
        raise SystemExit(2)


class AmirCLI(LightningCLI):
    """LightningCLI with the links the rollout loop needs."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
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

    def parse_arguments(self, parser, args) -> None:  # noqa: D102
        super().parse_arguments(parser, args)
        self.given = copy.deepcopy(self.config)  # before --ckpt_path's saved hyperparameters are laid over it
        subcommand = self.config.get("subcommand")
        if subcommand:  # Lightning reads the checkpoint next: a text file there would raise from torch
            resolve_resume(self.config[subcommand])
            check_checkpoint(self.config[subcommand].get("ckpt_path"))

    def before_instantiate_classes(self) -> None:  # noqa: D102
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
        if self.subcommand:  # no checkpoint without a subcommand
            keep_given_model_values(self.given[self.subcommand]["model"], config)
        link_completion_length(config)

    def instantiate_classes(self) -> None:  # noqa: D102
        super().instantiate_classes()
        self.datamodule.attach(self.model.handle)  # the data side's one way to the policy
        path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        saved = saved_checkpoint(path)
        if saved is not None:  # before the engine starts and the weights load: a foreign checkpoint fails in seconds
            check_base_model(saved.get("amir", {}).get("base_model"), self.model.base_model(), path)
            own, optional = self.model.expected_shapes()
            check_compatible(own, saved["state_dict"], path, optional)

    def instantiate_trainer(self, **kwargs):  # noqa: D102
        trainer = super().instantiate_trainer(**kwargs)
        install_atomic_checkpoints(trainer)  # a checkpoint is never half-written, whatever kills the run
        bar = trainer.progress_bar_callback
        if type(bar) in (TQDMProgressBar, RichProgressBar):  # Lightning's default: a bar per epoch, here a rollout
            trainer.callbacks[trainer.callbacks.index(bar)] = RunProgressBar(refresh_rate=bar.refresh_rate)
        return trainer

    def before_fit(self) -> None:  # noqa: D102
        if self.config[self.subcommand].get("validate_before_fit"):
            self.trainer.validate(self.model, datamodule=self.datamodule)


def build_cli(args: ArgsType = None, run: bool = True) -> AmirCLI:
    """The ``amir`` CLI over ``args``; ``run=False`` builds the module and data module without a subcommand."""
    return AmirCLI(
        AmirGRPOModule,
        RolloutDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_class=_Parser,
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``amir`` console script (LightningCLI subcommands, plus ``amir compare``)."""
    argv = list(args) if isinstance(args, list | tuple) else (sys.argv[1:] if args is None else None)
    if argv and argv[0] == "compare":
        from amir_lightning.evaluation.compare import main as compare_main

        return compare_main(argv[1:])
    if os.getcwd() not in sys.path:  # `class_path: my_rewards.X` and reward functions from where amir runs
        sys.path.insert(0, os.getcwd())
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when Ctrl-C is ignored (a background job)
        quiet_second_interrupt()
    if not isinstance(sys.stdout, PipeSafeStdout) and sys.stdout is not None:
        sys.stdout = PipeSafeStdout(sys.stdout)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no disk sync
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The module's logged values are reduced over processes already (torchmetrics, or sync_dist). Lightning still
    # asks for sync_dist on one device whenever torch.distributed is up, as the in-process vLLM engine makes it.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(", category=PossibleUserWarning)
    try:
        check_config_files(argv or [])
        build_cli(args)
    except USER_ERRORS as err:
        # Bad input is reported in one line that names the key or file; AMIR_DEBUG=1 shows the traceback.
        if os.environ.get("AMIR_DEBUG"):
            raise
        prefix = "trainer: " if isinstance(err, MisconfigurationException) else ""
        sys.stderr.write(f"amir: error: {prefix}{user_message(err)}\n(set AMIR_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
    except RewardError as err:  # the user's code: its own traceback, then one line naming the reward
        if os.environ.get("AMIR_DEBUG"):
            raise
        sys.stderr.write(user_traceback(err.__cause__) + f"amir: error: {err}\n")
        raise SystemExit(1) from None
    except SIGTERMException as err:  # preemption: a non-zero exit, so schedulers and `amir fit && ...` see it
        sys.stderr.write(f"amir: stopped by SIGTERM{getattr(err, 'amir_where', '')}\n")
        raise SystemExit(143) from None
    except KeyboardInterrupt:  # before or after the trainer runs (Lightning handles Ctrl-C while it does)
        sys.stderr.write("amir: interrupted\n")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
