"""Checkpoints: what they hold (what trains), how they are written (atomically, local or remote), the random state.

With LoRA a checkpoint holds the adapters, the loss's state, the optimizer and loop state, and the identity of the
frozen base model, which a resume checks before anything loads (``TrainableCheckpoint``).

Rollouts are seeded by their place in the run (``RolloutDataModule.generate``), so a resumed run already draws the
same rollouts; the global random states are saved too, for user code (rewards, callbacks) that draws from them.

Which checkpoint a run resumes from, and where checkpoints go, is ``resume.py``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from amir_lightning.models.loading import base_identity, is_peft
from amir_lightning.preflight import check_base_model, check_compatible
from amir_lightning.summary import format_bytes

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary sibling, then rename it over the target; local or remote (fsspec).

    A process killed mid-write leaves the previous checkpoint intact and only a ``.<name>.tmp-<pid>`` file, which
    nothing loads. On a local disk the file is flushed to disk before the rename; a remote path (``s3://``,
    ``gs://``, any fsspec protocol) is written through fsspec and moved into place. ``amir`` installs it in place of
    Lightning's default checkpoint writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:  # noqa: D102
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
                written = tmp.stat().st_size if tmp.exists() else 0
                tmp.unlink(missing_ok=True)
                raise CheckpointWriteError(_write_failure(target, recorded.error or err, written)) from None
            return
        parent = fs._parent(target)
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{posixpath.basename(target)}.tmp-{os.getpid()}"
        with fs.open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
        fs.mv(tmp, target)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None):  # noqa: D102
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
    """A checkpoint could not be written; the message names the path, the cause and the space it needs."""


def _write_failure(target: Path, err: BaseException, written: int) -> str:
    """One line: which checkpoint, why, how much it needs against how much is free, and what was kept."""
    cause = getattr(err, "strerror", None) or str(err).splitlines()[0]
    others = [p for p in target.parent.glob("*.ckpt") if p.is_file() and p.resolve() != target.resolve()]
    largest = max((p.stat().st_size for p in others), default=0)
    need = f"the last one took {format_bytes(largest)}" if others else f"{format_bytes(written)}+"
    try:
        free = f"{format_bytes(shutil.disk_usage(target.parent).free)} free there"
    except OSError:
        free = "the folder is gone"
    kept = "the previous checkpoint is intact" if others else "no earlier checkpoint"
    return f"could not write the checkpoint {target}: {cause} ({need}, {free}); the partial file was removed, {kept}"


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


def random_states() -> dict[str, Any]:
    """The python, numpy, torch (and CUDA) random states, as types a ``weights_only`` load accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_random_states(states: dict[str, Any]) -> None:
    """Restore what ``random_states`` captured."""
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class TrainableCheckpoint:
    """What a checkpoint of the policy module holds: what trains, and what a resume must check.

    A mixin of ``AmirGRPOModule`` (before ``LightningModule``): it reads the module's ``policy``, ``lora``,
    ``source``, ``model_dir``, ``trainer`` and ``_skipped_steps``. The module's ``state_dict`` (hence every
    checkpoint, single-file or distributed) leaves out the frozen base weights of a LoRA policy; a resume checks the
    base model's identity and the weights' shapes before loading.
    """

    def base_model(self) -> dict[str, str] | None:
        """The identity of the frozen base model a LoRA policy adapts (``base_identity``); ``None`` without LoRA."""
        if self.lora is None:
            return None
        source = getattr(self.source, "name_or_path", None) or type(self.source).__name__
        revision = getattr(self.source, "revision", None)
        return base_identity(self.model_dir, f"{source}@{revision}" if revision else source)

    def frozen_weights(self) -> set[str]:
        """State names of the frozen base weights of a LoRA policy (empty without LoRA or before the policy loads)."""
        if self.policy is None or not is_peft(self.policy):
            return set()
        return {
            f"policy.{name}" for name, p in self.policy.named_parameters(remove_duplicate=False) if not p.requires_grad
        }

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state without the frozen base weights of a LoRA policy: checkpoints hold what trains.

        The adapters, the loss's state, and (in the checkpoint, ``on_save_checkpoint``) the identity of the base
        model, which a resume checks; every weight when the whole policy trains.
        """
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for name in self.frozen_weights():
            state.pop(prefix + name, None)
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a checkpoint's state; only the frozen base weights of a LoRA policy may be absent.

        They come from ``model.policy``; anything else missing or unknown is an error when ``strict``.
        """
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        frozen = self.frozen_weights()
        missing = [name for name in result.missing_keys if name not in frozen]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"the checkpoint's state does not fit this module: missing {missing[:3]} ({len(missing)}), "
                f"unexpected {result.unexpected_keys[:3]} ({len(result.unexpected_keys)})"
            )
        return result

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Add the random states, the skipped-step count and the base model's identity under ``amir``."""
        checkpoint["amir"] = {
            "random_states": random_states(),
            "skipped_steps": self._skipped_steps,
            "base_model": self.base_model(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Check the checkpoint fits (base model, weight shapes); restore what ``on_save_checkpoint`` added."""
        path = self.trainer.ckpt_path
        check_base_model(checkpoint.get("amir", {}).get("base_model"), self.base_model(), path)
        if "state_dict" in checkpoint:  # a distributed checkpoint is loaded by the strategy, shard by shard
            own = super().state_dict()  # every weight: an older checkpoint may hold the base weights too
            check_compatible(own, checkpoint["state_dict"], path, optional=self.frozen_weights())
        if "amir" in checkpoint:
            restore_random_states(checkpoint["amir"]["random_states"])
            self._skipped_steps = checkpoint["amir"]["skipped_steps"]
