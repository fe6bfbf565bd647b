"""How a checkpoint is written: atomically (a temporary file or folder, then a rename), local or remote.

A checkpoint is never half-written, whatever stops the run; a write the disk refuses is one line naming the file,
the cause, the space the last one took and what is free, and a folder that takes no files (read-only, permission
denied) one line naming the folder and the cause (``CheckpointWriteError``). What a checkpoint holds is
``contents.py``; which one a run resumes from, and where checkpoints go, is ``resume.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from amir_lightning.helpers.sizes import format_bytes

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary sibling, then rename it over the target; local or remote (fsspec).

    A process killed mid-write leaves the previous checkpoint intact and only a ``.<name>.tmp-<pid>`` file, which
    nothing loads. On a local disk the file is flushed to disk before the rename; a remote path (``s3://``,
    ``gs://``, any fsspec protocol) is written through fsspec and moved into place. ``amir`` installs it in place of
    Lightning's default checkpoint writer.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        fs, target = url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem):
            target = Path(target)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            recorded = _KeepsWriteErrors(None)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as fh:
                    recorded.fh = fh
                    torch.save(checkpoint, recorded)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            except (OSError, RuntimeError) as err:  # torch reports a failed write as a RuntimeError of its own
                written = _size(tmp)
                left = _remove_partial(tmp)
                raise CheckpointWriteError(_write_failure(target, recorded.error or err, written, left)) from None
            return
        parent = fs._parent(target)
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{posixpath.basename(target)}.tmp-{os.getpid()}"
        with fs.open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
        fs.mv(tmp, target)

    @override
    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, EOFError, OSError) as err:  # cut short or changed since the start-up check
            if isinstance(err, FileNotFoundError | PermissionError):
                raise
            raise ValueError(
                f"--ckpt_path {path} could not be loaded ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
                "it may have been cut short: resume from an older checkpoint"
            ) from None


class _KeepsWriteErrors:
    """A binary file that keeps the error of a failed write.

    torch's archive writer reports its own instead ("unexpected pos ..."), which names neither the disk nor the cause.
    """

    def __init__(self, fh) -> None:
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.fh.flush()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the path, the cause and, for a full disk, the space."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove_partial(tmp: Path) -> str:
    """Remove what a failed write left at ``tmp``; what became of it, said in the error's line.

    A removal that fails is said, never raised: the write's error is the one to report. ``unlink`` on a read-only
    file system fails even where there is no file, so the file is looked for first.
    """
    if not os.path.lexists(tmp):
        return "no partial file was left"
    try:
        tmp.unlink()
    except OSError as err:
        return f"the partial file {tmp} could not be removed ({err.strerror or err})"
    return "the partial file was removed"


def _write_failure(target: Path, err: BaseException, written: int, left: str) -> str:
    """One line: which checkpoint, why, and what was kept; for a full disk, how much it needs against what is free.

    A folder that takes no files (read-only, not ours) is named with its cause; the space is not the matter there.
    """
    cause = getattr(err, "strerror", None) or str(err).splitlines()[0]
    try:
        others = [p for p in target.parent.glob("*.ckpt") if p.is_file() and p.resolve() != target.resolve()]
        largest = max((p.stat().st_size for p in others), default=0)
    except OSError:
        others, largest = [], 0
    kept = "the previous checkpoint is intact" if others else "no earlier checkpoint"
    if getattr(err, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"could not write the checkpoint {target}: the folder {target.parent} cannot be written to ({cause}); "
            f"{left}, {kept}: give checkpoint.dirpath (or the logger's save_dir) a folder this run can write"
        )
    need = f"the last one took {format_bytes(largest)}" if others else f"{format_bytes(written)}+"
    try:
        free = f"{format_bytes(shutil.disk_usage(target.parent).free)} free there"
    except OSError:
        free = "the folder is gone"
    return f"could not write the checkpoint {target}: {cause} ({need}, {free}); {left}, {kept}"


class AtomicFolderSave:
    """``ModelParallelStrategy.save_checkpoint`` for distributed checkpoints, made atomic.

    Every process writes its shards into the temporary sibling ``.<name>.tmp``; once all are written (and
    Lightning's ``meta.pt`` beside them), the first process renames it over the target. Lightning writes into the
    target folder itself, so a process killed mid-write would leave new shards beside an older ``meta.pt``: a
    checkpoint that loads, and mixes two steps.
    """

    def __init__(self, strategy, save) -> None:
        self.strategy, self.save = strategy, save

    def __call__(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:  # noqa: D102
        strategy = self.strategy
        target = Path(strategy.broadcast(str(filepath)))
        tmp = target.with_name(f".{target.name}.tmp")
        if strategy.is_global_zero:
            _remove(tmp)  # the leftover of a process killed while writing
        strategy.barrier()
        self.save(checkpoint, tmp, storage_options)
        strategy.barrier()
        if strategy.is_global_zero:
            old = target.with_name(f".{target.name}.old")
            _remove(old)
            if target.exists() or target.is_symlink():
                os.replace(target, old)
            os.replace(tmp, target)
            _remove(old)
        strategy.barrier()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def install_atomic_checkpoints(trainer) -> None:
    """Make every checkpoint write atomic.

    ``AtomicCheckpointIO`` where the strategy would use Lightning's plain writer, ``AtomicFolderSave`` where FSDP2
    (``ModelParallelStrategy``) writes distributed checkpoints.
    """
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    if isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint:
        strategy.save_checkpoint = AtomicFolderSave(strategy, strategy.save_checkpoint)
