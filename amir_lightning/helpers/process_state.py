"""The process state user code run inside the trainer (a reward, a tool) could change, and putting it back.

A reward or a tool runs in the training process: a ``chdir`` or a ``torch.set_grad_enabled(False)`` left behind
would change what the trainer does next, silently. Each call is bracketed by ``process_state`` and ``put_back``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)

_REPORTED: set[tuple[str, str]] = set()


def process_state() -> dict[str, Any]:
    """What a call could change: working directory, grad mode, default dtype, thread count."""
    return {
        "working directory": os.getcwd(),
        "grad mode": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
        "thread count": torch.get_num_threads(),
    }


def put_back(before: dict[str, Any], who: str) -> None:
    """Put back what ``who`` changed of ``before``, and say so once per caller and kind of change.

    ``who`` names the caller in the warning: ``reward accuracy``, ``tool calculator``.
    """
    after = process_state()
    for what, value in before.items():
        if after[what] == value:
            continue
        {
            "working directory": os.chdir,
            "grad mode": torch.set_grad_enabled,
            "default dtype": torch.set_default_dtype,
            "thread count": torch.set_num_threads,
        }[what](value)
        if (who, what) not in _REPORTED:
            _REPORTED.add((who, what))
            log.warning(
                "%s changed the %s (%r -> %r) and it was put back: it must leave the process as it found it",
                who,
                what,
                value,
                after[what],
            )
