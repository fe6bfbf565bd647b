"""Checks of a checkpoint before anything is built: a whole file, written by this model, with the shapes it needs.

Each failure is a ``ValueError`` (or ``FileNotFoundError``) whose message names the key or the file, so the CLI
prints one line instead of a traceback from YAML, Lightning or torch minutes later.
"""

from __future__ import annotations

import zipfile
from collections import OrderedDict
from pathlib import Path

#: ``--ckpt_path`` values Lightning resolves itself.
_SPECIAL_CHECKPOINTS = ("last", "best", "hpc", "registry")

#: The prefix of the trained weights' names in the module's state (``AmirGRPOModule.model``), and the one
#: checkpoints written before that attribute was renamed use.
WEIGHTS_PREFIX, OLDER_WEIGHTS_PREFIX = "model.", "policy."


def renamed_keys(state_dict: dict) -> tuple[dict, bool]:
    """``state_dict`` with the older weight names ``policy.<x>`` as ``model.<x>``, and whether it renamed any.

    A checkpoint holding ``model.`` names already (or no ``policy.`` name) comes back as it is. The tensors are the
    same objects; torch's per-module ``_metadata`` of the state is renamed alike.
    """
    if any(k.startswith(WEIGHTS_PREFIX) for k in state_dict) or not any(
        k.startswith(OLDER_WEIGHTS_PREFIX) for k in state_dict
    ):
        return state_dict, False
    mapped = OrderedDict((_renamed(k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # keyed by module prefix: "policy", "policy.model.layers.0", ...
        mapped._metadata = OrderedDict((_renamed(k + ".")[:-1], v) for k, v in metadata.items())
    return mapped, True


def _renamed(name: str) -> str:
    return WEIGHTS_PREFIX + name[len(OLDER_WEIGHTS_PREFIX) :] if name.startswith(OLDER_WEIGHTS_PREFIX) else name


def check_checkpoint(path: str | None) -> None:
    """``--ckpt_path`` must be a checkpoint: a torch file (a zip archive, whole) or a distributed checkpoint folder.

    Local or remote (any fsspec path, ``s3://...``): a remote file is checked by its index at the end, not read.
    """
    if path is None or path in _SPECIAL_CHECKPOINTS:
        return
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, file = url_to_fs(str(path))
    if not fs.exists(file):
        raise FileNotFoundError(f"--ckpt_path {path} does not exist")
    if fs.isdir(file):
        if not fs.isfile(f"{file.rstrip('/')}/.metadata"):
            raise ValueError(f"--ckpt_path {path} is not a checkpoint: a folder without a distributed checkpoint")
        if isinstance(fs, LocalFileSystem):
            check_distributed_names(file, path)
        return
    try:
        with fs.open(file, "rb") as fh, zipfile.ZipFile(fh) as archive:  # the index at the end: a cut file has none
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                raise zipfile.BadZipFile("no data.pkl")
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"--ckpt_path {path} is not a checkpoint (not a whole torch archive: {err})") from None


def check_distributed_names(folder: str, path: str) -> None:
    """A distributed checkpoint (FSDP2) must name the trained weights ``model.<x>``: its index is read, no shard.

    The strategy loads it shard by shard into the module's names, so one written with the older ``policy.<x>``
    names cannot be renamed on the way (``renamed_keys`` does that for a whole checkpoint).
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        names = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - an unreadable index is Lightning's to report when it loads
        return
    if any(name.startswith("state_dict." + OLDER_WEIGHTS_PREFIX) for name in names):
        raise ValueError(
            f"--ckpt_path {path} is a distributed checkpoint written with the older weight names "
            f"({OLDER_WEIGHTS_PREFIX}*, now {WEIGHTS_PREFIX}*), which cannot be mapped as its shards load: resume it "
            "with the earlier version of amir_lightning, or re-save it there as a whole checkpoint "
            "(--trainer.strategy.init_args.save_distributed_checkpoint false), which loads here under DDP or one device"
        )


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
    for kind, prefix in (("another model", WEIGHTS_PREFIX), ("another objective (model.loss)", "")):
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
