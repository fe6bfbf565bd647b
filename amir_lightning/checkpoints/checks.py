"""Checks of a checkpoint before anything is built: a whole file, written by this model, with the shapes it needs.

Each failure is a ``ValueError`` (or ``FileNotFoundError``) whose message names the key or the file, so the CLI
prints one line instead of a traceback from YAML, Lightning or torch minutes later.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

#: ``--ckpt_path`` values Lightning resolves itself.
_SPECIAL_CHECKPOINTS = ("last", "best", "hpc", "registry")


def check_checkpoint(path: str | None) -> None:
    """``--ckpt_path`` must be a checkpoint: a torch file (a zip archive, whole) or a distributed checkpoint folder.

    Local or remote (any fsspec path, ``s3://...``): a remote file is checked by its index at the end, not read.
    """
    if path is None or path in _SPECIAL_CHECKPOINTS:
        return
    from fsspec.core import url_to_fs

    fs, file = url_to_fs(str(path))
    if not fs.exists(file):
        raise FileNotFoundError(f"--ckpt_path {path} does not exist")
    if fs.isdir(file):
        if not fs.isfile(f"{file.rstrip('/')}/.metadata"):
            raise ValueError(f"--ckpt_path {path} is not a checkpoint: a folder without a distributed checkpoint")
        return
    try:
        with fs.open(file, "rb") as fh, zipfile.ZipFile(fh) as archive:  # the index at the end: a cut file has none
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                raise zipfile.BadZipFile("no data.pkl")
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"--ckpt_path {path} is not a checkpoint (not a whole torch archive: {err})") from None


def saved_checkpoint(path: str | None) -> dict | None:
    """A whole local checkpoint file, memory-mapped (no weight is read); None for anything else.

    A remote checkpoint is checked when Lightning loads it (``TrainableCheckpoint.on_load_checkpoint``), rather
    than downloaded twice.
    """
    import torch
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if path is None or path in _SPECIAL_CHECKPOINTS or not isinstance(url_to_fs(str(path))[0], LocalFileSystem):
        return None
    path = url_to_fs(str(path))[1]
    if Path(path).is_dir():
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to unpickle means the file is not ours
        raise ValueError(f"--ckpt_path {path} is not a checkpoint this package wrote ({type(err).__name__})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"--ckpt_path {path} is not a Lightning checkpoint: it has no state_dict")
    return checkpoint


def check_base_model(saved: dict | None, own: dict, path: str | None) -> None:
    """LoRA adapters resume only on the base model they were trained on (``base_identity`` of both must agree)."""
    if not saved:
        return
    if saved["config_sha256"] != own["config_sha256"] or saved["weights_sha256"] != own["weights_sha256"]:
        what = "config" if saved["config_sha256"] != own["config_sha256"] else "weights"
        raise ValueError(
            f"checkpoint {path} holds LoRA adapters trained on the base model {saved['source']}, but model.policy is "
            f"{own['source']} here and its {what} differ (sha256 {saved[what + '_sha256'][:12]} there, "
            f"{own[what + '_sha256'][:12]} here): the adapters would act on other weights. Resume with the base model "
            "they were trained on."
        )


def check_compatible(own: dict, saved: dict, path: str | None, optional: set[str] | frozenset = frozenset()) -> None:
    """The checkpoint's weights must be this run's: same policy weights and loss state, same shapes.

    ``own`` maps names to shapes or tensors, ``saved`` names to tensors; names in ``optional`` (the frozen base
    weights of a LoRA policy) may be absent from the checkpoint. The first difference is named.
    """
    where = f"checkpoint {path}" if path else "the checkpoint"
    redo = "resume with the configuration it was trained with"
    for name, value in own.items():
        shape = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
        if name in saved and tuple(saved[name].shape) != shape:
            raise ValueError(
                f"{where} was written by another model: {name} has shape {tuple(saved[name].shape)} there and "
                f"{shape} here; {redo}"
            )
    for kind, prefix in (("another model", "policy."), ("another objective (model.loss)", "")):
        missing = sorted(name for name in own if name.startswith(prefix) and name not in saved and name not in optional)
        extra = sorted(name for name in saved if name.startswith(prefix) and name not in own)
        if missing:
            raise ValueError(
                f"{where} was written by {kind}: it has no {missing[0]} ({len(missing)} of this run's "
                f"weights and buffers are missing); {redo}"
            )
        if extra:
            raise ValueError(
                f"{where} was written by {kind}: this run has no {extra[0]} ({len(extra)} of the "
                f"checkpoint's weights and buffers are unknown here); {redo}"
            )
