"""The ``amir`` command: LightningCLI over AmirGRPOModule and RolloutDataModule.

amir fit --config configs/demo.yaml
amir validate --config configs/demo.yaml
amir fit --config configs/qwen.yaml --model.loss amir_lightning.objectives.GRPOLoss
"""

from __future__ import annotations

import logging
import os
import sys

from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from amir_lightning.checkpointing import install_atomic_checkpoints
from amir_lightning.models.precision import check_strategy
from amir_lightning.module import AmirGRPOModule
from amir_lightning.rollout.datamodule import RolloutDataModule
from amir_lightning.rollout.sync import StaleEngineError

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
)


def _check_config_files(argv: list[str]) -> None:
    """Parse every ``--config`` file first, so that a YAML error names the file (jsonargparse names a string)."""
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                yaml.safe_load(fh)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None


def user_message(err: BaseException) -> str:
    """The useful lines of an input error.

    jsonargparse reports a failing optional component as a Union mismatch listing every alternative and the whole
    given value; only the component's own complaint is kept.
    """
    text = str(err)
    if "Does not validate against any of the Union subtypes" not in text:
        return text
    reasons = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")]
    reasons = [r for r in reasons if not r.startswith("Expected a <class 'NoneType'>")]
    return "; ".join(reasons) or text


class AmirCLI(LightningCLI):
    """LightningCLI with the links the rollout loop needs."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        # The training log-probs must be those of the distribution that was sampled.
        parser.link_arguments("data.sampling.temperature", "model.temperature")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # Save after every rollout (epoch), not only after validation epochs: a killed run loses one rollout at most.
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_on_train_epoch_end": True})
        parser.add_argument(
            "--validate_before_fit",
            type=bool,
            default=False,
            help="Run validation once before training (held-out accuracy of the initial policy).",
        )

    def before_instantiate_classes(self) -> None:  # noqa: D102
        config = self.config.get(self.subcommand) if self.subcommand else None
        if config is None:
            return
        if "weights_only" in config and config["weights_only"] is None:
            config["weights_only"] = True  # checkpoints are loaded as data, never as code
        strategy = config["trainer"]["strategy"]
        # Before Lightning builds the trainer, so the message is this one whatever the accelerator.
        check_strategy(strategy if isinstance(strategy, str) else strategy.get("class_path", ""))

    def instantiate_trainer(self, **kwargs):  # noqa: D102
        trainer = super().instantiate_trainer(**kwargs)
        install_atomic_checkpoints(trainer)  # a checkpoint is never half-written, whatever kills the run
        return trainer

    def before_fit(self) -> None:  # noqa: D102
        if self.config[self.subcommand].get("validate_before_fit"):
            self.trainer.validate(self.model, datamodule=self.datamodule)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``amir`` console script (LightningCLI subcommands, plus ``amir compare``)."""
    argv = list(args) if isinstance(args, list | tuple) else (sys.argv[1:] if args is None else None)
    if argv and argv[0] == "compare":
        from amir_lightning.evaluation.compare import main as compare_main

        return compare_main(argv[1:])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no disk sync
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _check_config_files(argv or [])
        AmirCLI(
            AmirGRPOModule,
            RolloutDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
        )
    except USER_ERRORS as err:
        # Bad input is reported in one line that names the key or file; AMIR_DEBUG=1 shows the traceback.
        if os.environ.get("AMIR_DEBUG"):
            raise
        sys.stderr.write(f"amir: error: {user_message(err)}\n(set AMIR_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
