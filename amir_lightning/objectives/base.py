"""What every objective returns, and the autograd bridge for gradients computed in closed form."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Stats that describe the step as a whole rather than a micro-batch's share of it (take the last, don't sum).
INTENSIVE_STATS = frozenset({"lambda"})


@dataclass
class LossOutput:
    """What every objective returns.

    Attributes:
        loss: Scalar to back-propagate; micro-batch shares of a step sum to the full-batch loss.
        stats: Detached scalars for logging; additive over micro-batches except ``INTENSIVE_STATS``.
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class WithGrad(torch.autograd.Function):
    """Return ``value`` whose gradient with respect to ``inputs`` is the precomputed ``grad``.

    The objectives compute their gradient in closed form in the forward pass: a handful of fused tensor passes
    instead of an autograd graph of ~30 ``[N, T]`` nodes (the log-probs' own graph back to the logits is untouched).
    """

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: D102
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None
