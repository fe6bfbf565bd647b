"""Checks of the command line's config files and trainer values before anything is built.

Each failure is a ``ValueError`` (or ``FileNotFoundError``) whose message names the key or the file, so the CLI
prints one line instead of a traceback from YAML or Lightning minutes later.
"""

from __future__ import annotations

from pathlib import Path

from amir_lightning.helpers.validation import check_number, raise_errors

#: The accelerators a policy trains on here (TPUs and HPUs would need their own strategies).
_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_config_files(argv: list[str]) -> None:
    """Read every ``--config`` file first, so that a bad one is named (jsonargparse would name a string)."""
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        file = Path(path)
        if file.is_dir():
            raise ValueError(f"config file {path} is a directory")
        try:
            text = file.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} does not exist") from None
        except UnicodeDecodeError as err:
            byte = err.object[err.start]
            raise ValueError(f"config file {path} is not UTF-8 text (byte {err.start} is {byte:#x})") from None
        if not text.strip():
            raise ValueError(f"config file {path} is empty")
        try:
            content = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(content, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys, got {type(content).__name__}")


def check_trainer(trainer) -> None:
    """Limits Lightning would take and fail on later (a negative epoch count, validation every 0 epochs)."""
    errors: list[str] = []
    check_number(errors, "trainer.max_epochs", trainer.get("max_epochs"), ge=-1, optional=True)
    check_number(errors, "trainer.max_steps", trainer.get("max_steps"), ge=-1, optional=True)
    check_number(errors, "trainer.check_val_every_n_epoch", trainer.get("check_val_every_n_epoch"), ge=1, optional=True)
    check_number(errors, "trainer.log_every_n_steps", trainer.get("log_every_n_steps"), ge=1, optional=True)
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str) and accelerator not in _ACCELERATORS:
        errors.append(f"trainer.accelerator must be one of {', '.join(_ACCELERATORS)}, got {accelerator!r}")
    raise_errors(errors)
