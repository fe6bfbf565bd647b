"""The optimiser's side of a step: parameter groups, the global gradient norm, and no non-finite step applied.

A step whose loss or gradient is NaN or infinite on any process is skipped everywhere (the gradient is dropped,
nothing moves); ``max_bad_steps`` such steps in a row stop the run before any is applied.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch.utilities import rank_zero_warn

from amir_lightning.helpers.distributed import all_reduce


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """The trainable parameters in two groups: matrices, and the 1-D ones (biases, norm weights) without decay.

    As in Hugging Face's Trainer; an empty group is left out.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2]}, {"params": [p for p in trainable if p.ndim < 2]}]
    groups[1]["weight_decay"] = 0.0
    return [g for g in groups if g["params"]]


def clip_global_norm(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of ``model`` to ``max_norm`` (``None``: no clipping); returns their norm before it.

    The global norm under every strategy: DDP's gradients are already averaged, and FSDP2's are DTensor shards whose
    norm torch reduces over the mesh (tests/e2e/test_distributed.py pins both).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class BadStepGuard:
    """Counts the optimisation steps skipped for a non-finite loss or gradient, and stops a run of them.

    Args:
        max_bad_steps: Skipped steps in a row that stop the run (``model.max_bad_steps``).
    """

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps, self.in_a_row, self.skipped = max_bad_steps, 0, 0

    def applied(self) -> None:
        """A step was applied: the count of bad steps in a row starts again."""
        self.in_a_row = 0

    def skip(self, step: int) -> None:
        """Step ``step`` is skipped: say so, or stop the run when it is the ``max_bad_steps``-th in a row."""
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= self.max_bad_steps:
            raise FloatingPointError(
                f"{self.in_a_row} optimisation steps in a row had a non-finite loss or gradient (model.max_bad_steps="
                f"{self.max_bad_steps}); stopped at step {step} before applying any. Lower the learning rate, check "
                "the rewards, or resume from the last checkpoint."
            )
        rank_zero_warn(
            f"skipped optimisation step {step}: non-finite loss or gradient "
            f"({self.in_a_row} in a row, model.max_bad_steps={self.max_bad_steps})"
        )


def apply_step(
    model: torch.nn.Module,
    optimizer,
    scheduler,
    max_grad_norm: float | None,
    bad: bool,
    guard: BadStepGuard,
    step: int,
) -> torch.Tensor | None:
    """Clip the gradients, then step ``optimizer`` and ``scheduler``; returns the gradient norm before clipping.

    A step that is ``bad`` (a non-finite loss) on any process, or whose gradient norm is not finite, is skipped on
    every process (a collective): the gradient is dropped, ``guard`` counts it, and ``None`` is returned.
    """
    grad_norm = clip_global_norm(model, max_grad_norm)
    flag = torch.tensor([float(bad or not torch.isfinite(grad_norm))])
    bad = bool(all_reduce(flag, "max", next(model.parameters()).device)[0])  # CUDA for NCCL
    if not bad:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if bad:
        guard.skip(step)
        return None
    guard.applied()
    return grad_norm
