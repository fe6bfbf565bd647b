"""The AMIR-GRPO pairwise term: a DPO-style logistic loss on mined (chosen, rejected) pairs.

    z_ij   = beta * [(l(o_i) - l_ref(o_i)) - (l(o_j) - l_ref(o_j))]       l_ref = 0 when reference-free
    L_pref = -(1 / P_step) * sum_{(i, j)} log sigmoid(z_ij)

``l`` is a sequence log-prob (``sequence_logps``) computed from the token log-probs of the policy-gradient
forward pass: the pair term never runs a second forward (the official code re-forwards every pair).
The mean pools all pairs of the optimisation step (not a mean of per-group means), so a group with more pairs
weighs more, as in the official code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pair_logits(
    seq_logps: torch.Tensor,
    pairs: torch.Tensor,
    beta: float,
    ref_seq_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the DPO logits ``z`` ``[P]`` and the policy margins ``l_c - l_r`` ``[P]`` of ``pairs``."""
    chosen, rejected = pairs[:, 0], pairs[:, 1]  # [P], [P]
    margins = seq_logps[chosen] - seq_logps[rejected]  # [P]
    if ref_seq_logps is None:
        return beta * margins, margins
    ref_margins = ref_seq_logps[chosen] - ref_seq_logps[rejected]  # [P]
    return beta * (margins - ref_margins), margins


def preference_loss(
    seq_logps: torch.Tensor,
    pairs: torch.Tensor,
    beta: float,
    ref_seq_logps: torch.Tensor | None = None,
    num_pairs: float | None = None,
) -> torch.Tensor:
    """Pooled logistic pair loss ``-sum log sigmoid(z) / num_pairs``.

    Args:
        seq_logps: ``[N]`` sequence log-probs under the policy.
        pairs: ``LongTensor[P, 2]`` of (chosen, rejected) indices into ``seq_logps``.
        beta: Inverse temperature of the logistic (``beta_dpo`` of the paper).
        ref_seq_logps: ``[N]`` reference sequence log-probs, or ``None`` for the reference-free form.
        num_pairs: Pairs in the whole optimisation step (for micro-batching); defaults to ``P``.

    Returns:
        Scalar loss; ``0`` (still attached to the graph) when there are no pairs.
    """
    if ref_seq_logps is not None:
        ref_seq_logps = ref_seq_logps.detach()
    z, _ = pair_logits(seq_logps, pairs, beta, ref_seq_logps)  # [P]
    denom = float(pairs.shape[0]) if num_pairs is None else float(num_pairs)
    if pairs.shape[0] == 0:
        return seq_logps.sum() * 0.0
    return -F.logsigmoid(z).sum() / max(denom, 1.0)
