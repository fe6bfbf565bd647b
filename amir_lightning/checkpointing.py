"""Checkpoints that survive being killed: atomic writes, and the random state restored on resume.

Rollouts are seeded by their place in the run (``RolloutDataModule.generate``), so a resumed run already draws the
same rollouts; the global random states are saved too, for user code (rewards, callbacks) that draws from them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


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
