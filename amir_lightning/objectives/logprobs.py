"""Per-token log-probabilities of the sampled tokens, without materialising a ``[N, T, V]`` log-softmax.

    log pi(y_t) = z_t[y_t] / tau - logsumexp(z_t / tau)

computed row by row in float32, so peak extra memory is one ``[T, V]`` slice (the official AMIR code takes a
full-vocabulary ``log_softmax`` over prompt and completion positions in bf16).
"""

from __future__ import annotations

import torch


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1,
) -> torch.Tensor:
    """Log-probabilities of ``index`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[N, T, V]`` next-token logits aligned with ``index`` (already shifted by the caller).
        index: ``[N, T]`` token ids whose log-probabilities are wanted.
        temperature: Sampling temperature; the log-probs are those of the distribution that was sampled.
        chunk_size: Rows of ``N`` processed at once; bounds the float32 working set to ``chunk_size * T * V``.

    Returns:
        ``[N, T]`` float32 log-probabilities, differentiable with respect to ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and index {tuple(index.shape)} disagree on [N, T]")
    out = []
    for rows, ids in zip(logits.split(chunk_size), index.split(chunk_size)):
        scaled = rows.float() / temperature  # [n, T, V]
        picked = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [n, T]
        out.append(picked - torch.logsumexp(scaled, dim=-1))  # [n, T]
    return torch.cat(out)  # [N, T]


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at each position, ``[N, T]`` (for logging only)."""
    out = []
    for rows in logits.split(chunk_size):
        scaled = rows.float() / temperature  # [n, T, V]
        logp = torch.log_softmax(scaled, dim=-1)  # [n, T, V]
        out.append(-(logp.exp() * logp).sum(-1))  # [n, T]
    return torch.cat(out)  # [N, T]


def sequence_logps(
    token_logps: torch.Tensor,
    mask: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    """Sequence log-probability from token log-probs over completion tokens only.

    Args:
        token_logps: ``[N, T]`` per-token log-probabilities.
        mask: ``[N, T]`` 1 on completion tokens, 0 on padding.
        reduction: ``"mean"`` (length-normalised, the official code since 4c0182b) or ``"sum"`` (its first
            commit). An empty completion has mean 0.

    Returns:
        ``[N]`` sequence log-probabilities.
    """
    mask = mask.to(token_logps.dtype)
    total = (token_logps * mask).sum(-1)  # [N]
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / mask.sum(-1).clamp(min=1.0)  # [N]
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
