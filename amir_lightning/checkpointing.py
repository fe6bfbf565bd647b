"""Checkpoints: what they hold (what trains), atomic writes, which one a run resumes from, and the random state.

With LoRA a checkpoint holds the adapters, the loss's state, the optimizer and loop state, and the identity of the
frozen base model, which a resume checks before anything loads (``TrainableCheckpoint``).

Rollouts are seeded by their place in the run (``RolloutDataModule.generate``), so a resumed run already draws the
same rollouts; the global random states are saved too, for user code (rewards, callbacks) that draws from them.

``--ckpt_path last`` finds the newest ``last.ckpt`` of the run's name (``resolve_resume``) and logs into the same
version folder, so a restarted job (preemption, a SLURM requeue) continues its run and its curves; ``auto`` does the
same, or starts fresh when there is none. Lightning alone looks for ``last`` only in the new run's own folder.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from amir_lightning.models.loading import base_identity, is_peft
from amir_lightning.preflight import check_base_model, check_compatible

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary sibling, flush it to disk, then rename it over the target.

    A process killed mid-write leaves the previous checkpoint intact and only a ``.<name>.tmp-<pid>`` file, which
    nothing loads. ``amir`` installs it in place of Lightning's default checkpoint writer.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:  # noqa: D102
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)


def install_atomic_checkpoints(trainer) -> None:
    """Use ``AtomicCheckpointIO`` where the strategy would use Lightning's plain writer (not for sharded saves)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


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


def resolve_resume(config) -> None:
    """Turn ``ckpt_path`` ``last`` / ``auto`` into this run name's newest ``last.ckpt``, and log beside it.

    Looks in ``checkpoint.dirpath`` when set, else in every ``version_N/checkpoints`` of the first logger's
    ``save_dir/name`` (TensorBoard, CSV). Found: ``ckpt_path`` becomes that file and the logger's ``version`` that
    folder's, so the curves continue. Not found: ``auto`` starts fresh; ``last`` is an error naming where it looked.
    """
    wanted = config.get("ckpt_path")
    if wanted not in ("last", "auto"):
        return
    found, version, where = _newest_last_checkpoint(config)
    if found is None:
        if wanted == "last":
            raise FileNotFoundError(
                f"--ckpt_path last: no last.ckpt in {where}; --ckpt_path auto starts fresh when there is none"
            )
        log.warning("--ckpt_path auto: no last.ckpt in %s, starting a new run", where)
        config["ckpt_path"] = None
        return
    config["ckpt_path"] = str(found)
    if version is not None:
        _first_logger(config)["init_args"]["version"] = version
    log.warning("--ckpt_path %s: resuming from %s", wanted, found)


def _first_logger(config):
    logger = config["trainer"].get("logger")
    logger = logger[0] if isinstance(logger, list) and logger else logger
    init = logger.get("init_args") if hasattr(logger, "get") else None
    return logger if init is not None and init.get("save_dir") is not None else None


def _newest_last_checkpoint(config) -> tuple[Path | None, int | None, str]:
    """``(last.ckpt, its logger version, where it was looked for)``; ``None`` for what is not there."""
    dirpath = config.get("checkpoint", {}).get("dirpath") if hasattr(config, "get") else None
    if dirpath:
        return _last_in(Path(dirpath)), None, str(dirpath)
    logger = _first_logger(config)
    if logger is None:
        return None, None, "the run (set checkpoint.dirpath: the first logger has no save_dir/name folders)"
    init = logger["init_args"]
    root = Path(init["save_dir"]) / (init.get("name") or "")
    given = init.get("version")
    if given is not None:
        folder = root / (given if isinstance(given, str) else f"version_{given}")
        return _last_in(folder / "checkpoints"), None, str(folder / "checkpoints")
    versions = sorted(
        (int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))),
        reverse=True,
    )
    for version in versions:
        last = _last_in(root / f"version_{version}" / "checkpoints")
        if last is not None:
            return last, version, str(root / "version_*" / "checkpoints")
    return None, None, str(root / "version_*" / "checkpoints")


def _last_in(folder: Path) -> Path | None:
    """``last.ckpt`` in ``folder``, or the newest checkpoint there when it links to one that is gone.

    ``last.ckpt`` links to the rollout's checkpoint; a process killed after writing the next one and removing the
    old one, but before relinking, leaves the link dangling.
    """
    last = folder / "last.ckpt"
    if last.exists():
        return last
    if not folder.is_dir():
        return None
    saved = [p for p in folder.glob("*.ckpt") if p.exists() and not p.name.startswith(".")]
    return max(saved, key=lambda p: p.stat().st_mtime) if saved else None
