"""What a checkpoint holds: what trains, the identity of a LoRA policy's frozen base, and the random states.

With LoRA a checkpoint holds the adapters, the loss's state, the optimizer and loop state, and the identity of the
frozen base model, which a resume checks before anything loads (``TrainableCheckpoint``).

Rollouts are seeded by their place in the run (``RolloutDataModule.generate``), so a resumed run already draws the
same rollouts; the global random states are saved too, for user code (rewards, callbacks) that draws from them.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from amir_lightning.checkpoints.checks import WEIGHTS_PREFIX, check_base_model, check_compatible, renamed_keys
from amir_lightning.models.loading import base_identity, is_peft, policy_shapes

log = logging.getLogger(__name__)


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

    A mixin of ``AmirGRPOModule`` (before ``LightningModule``): it reads the module's ``model`` (the trained
    ``nn.Module``, whose weights are the state's ``model.*``), ``policy`` (its ``Policy``: ``model_dir``), ``lora``,
    ``source``, ``trainer`` and ``bad_steps``. The module's ``state_dict`` (hence every checkpoint, single-file or
    distributed) leaves out the frozen base weights of a LoRA policy; a resume checks the base model's identity and
    the weights' shapes before loading.
    """

    def base_model(self) -> dict[str, str] | None:
        """The identity of the frozen base model a LoRA policy adapts (``base_identity``); ``None`` without LoRA."""
        if self.lora is None:
            return None
        source = getattr(self.source, "name_or_path", None) or type(self.source).__name__
        revision = getattr(self.source, "revision", None)
        return base_identity(self.policy.model_dir, f"{source}@{revision}" if revision else source)

    def frozen_weights(self) -> set[str]:
        """State names of the frozen base weights of a LoRA policy (empty without LoRA or before the policy loads)."""
        if self.model is None or not is_peft(self.model):
            return set()
        named = self.model.named_parameters(remove_duplicate=False)
        return {f"{WEIGHTS_PREFIX}{name}" for name, p in named if not p.requires_grad}

    def expected_shapes(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """This module's state as shapes, without loading the policy, and the names a checkpoint may leave out.

        The state: policy weights and loss buffers; left out: the frozen base weights of a LoRA policy.
        """
        built, frozen = policy_shapes(self.policy.model_dir, self.lora, self.source.trust_remote_code)
        shapes = {f"{WEIGHTS_PREFIX}{name}": shape for name, shape in built.items()}
        own = shapes | {k: tuple(v.shape) for k, v in self.state_dict().items() if not k.startswith(WEIGHTS_PREFIX)}
        return own, {f"{WEIGHTS_PREFIX}{name}" for name in frozen}

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
            "skipped_steps": self.bad_steps.skipped,
            "base_model": self.base_model(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Check the checkpoint fits (base model, weight shapes); restore what ``on_save_checkpoint`` added.

        Lightning loads ``checkpoint["state_dict"]`` after this hook, so the older weight names ``policy.<x>`` are
        renamed ``model.<x>`` here (``renamed_keys``).
        """
        path = self.trainer.ckpt_path
        check_base_model(checkpoint.get("amir", {}).get("base_model"), self.base_model(), path)
        if "state_dict" in checkpoint:  # a distributed checkpoint is loaded by the strategy, shard by shard
            checkpoint["state_dict"], renamed = renamed_keys(checkpoint["state_dict"])
            if renamed and self.trainer.is_global_zero:
                log.warning(
                    "checkpoint %s was written with the older weight names policy.*: mapped to model.* to load it",
                    path,
                )
            own = super().state_dict()  # every weight: an older checkpoint may hold the base weights too
            check_compatible(own, checkpoint["state_dict"], path, optional=self.frozen_weights())
        if "amir" in checkpoint:
            restore_random_states(checkpoint["amir"]["random_states"])
            self.bad_steps.skipped = checkpoint["amir"]["skipped_steps"]
