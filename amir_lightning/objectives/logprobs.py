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


class _ChosenTokenLogps(torch.autograd.Function):
    """``log softmax(h W^T / tau)[y]`` per row, chunk by chunk; the backward recomputes each chunk's logits.

    Only ``[M]`` log-probs (and their logsumexps, for the backward) outlive a chunk: no ``[M, V]`` tensor is kept
    for autograd. The matmuls run in ``dtype`` (the autocast dtype of the caller, or the weight's), the softmax in
    float32, as the materialised path does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, dtype, want_entropy: bool):
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if want_entropy else None
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _scaled_logits(hidden[rows].to(dtype), w, temperature)  # [c, V]
            lse[rows] = torch.logsumexp(z, dim=-1)
            logps[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            if entropy is not None:
                entropy[rows] = lse[rows] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        if entropy is None:
            return logps, torch.empty(0, device=hidden.device)
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        w = weight.to(ctx.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows].to(ctx.dtype)
            g = grad_logps[rows].float()  # [c]
            # d logp_y / d z = onehot(y) - softmax(z), then through z = logits / tau; in place: one [c, V] tensor
            dz = _scaled_logits(h, w, ctx.temperature).sub_(lse[rows, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(-1, targets[rows, None], g[:, None])
            dz = dz.div_(ctx.temperature).to(ctx.dtype)
            if need_hidden:
                grad_hidden[rows] = (dz @ w).to(hidden.dtype)
            if need_weight:
                grad_weight += (dz.T @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``float32(hidden @ weight.T) / temperature`` as one fresh ``[c, V]`` tensor (scaled in place)."""
    z = torch.nn.functional.linear(hidden, weight)
    z = z.float() if z.dtype != torch.float32 else z
    return z.div_(temperature) if temperature != 1.0 else z


def chosen_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, never holding ``[M, V]`` logits.

    The LM head and the log-softmax are fused, ``chunk_size`` rows at a time, with a backward that recomputes each
    chunk (the idea of Liger-Kernel's and Cut Cross-Entropy's fused linear cross-entropy). Values and gradients
    equal ``selective_log_softmax(hidden @ weight.T, targets, temperature)`` to float tolerance.

    Args:
        hidden: ``[M, H]`` final hidden states (after the last norm) of the positions that predict ``targets``.
        weight: ``[V, H]`` the LM head (the output embeddings).
        targets: ``[M]`` token ids.
        temperature: Sampling temperature.
        chunk_size: Rows whose ``[chunk, V]`` logits exist at once.
        entropy: Also return each row's entropy (computed from the same chunks, no gradient).

    Returns:
        ``[M]`` float32 log-probs, differentiable with respect to ``hidden`` and ``weight``; ``[M]`` entropies or
        ``None``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device_type=device, enabled=False):
        logps, entropies = _ChosenTokenLogps.apply(hidden, weight, targets, temperature, chunk_size, dtype, entropy)
    return logps, (entropies if entropy else None)
