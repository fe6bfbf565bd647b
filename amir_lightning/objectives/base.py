"""What every objective is given once per optimisation step, and what it returns per micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from amir_lightning.objectives.pairs import MinedGroups


@dataclass(frozen=True)
class StepContext:
    """The facts of one optimisation step that every micro-batch shares, computed once, over all processes.

    Attributes:
        num_sequences: Completions in the step.
        num_tokens: Policy tokens (loss-mask sums: a tool's replies are not counted) in the policy-gradient term.
        max_length: ``L`` of ``dr_grpo``: ``max_completion_length`` or the step's longest completion (in policy
            tokens).
        num_pairs: Preference pairs mined in the step (the pair losses are pooled over them).
        lambda_: Weight of the pair term during this step (0 for GRPO); schedules update it after the step.
        mined: The step's groups and their pairs, mined once (``step_context``): each micro-batch finds its own
            groups' pairs there.
    """

    num_sequences: float
    num_tokens: float
    max_length: float
    num_pairs: float = 0.0
    lambda_: float = 0.0
    mined: MinedGroups | None = None


@dataclass
class RowDiagnostics:
    """Per-completion facts of one micro-batch, for monitors that aggregate them (none recomputes the loss).

    Attributes:
        seq_logps: ``[n]`` mean token log-prob of each completion (the length-normalised ``l`` of the paper).
        pg_token_weight: ``[n]`` gradient weight each token of the completion gets from the policy-gradient term,
            ``|A_i| w_i`` (``w_i`` the aggregation's token weight: ``1 / (N |o_i|)`` for ``grpo``).
        pairs: ``LongTensor[P, 2]`` (chosen, rejected) row indices of the pairs mined in this micro-batch.
        pair_push: ``[n]`` per-token push-down the pair term gives each completion, ``lambda * |dL_pref / dl_i|``
            summed over the pairs it loses (divided by ``|o_i|`` for mean log-probs); ``None`` without a pair term.
    """

    seq_logps: torch.Tensor
    pg_token_weight: torch.Tensor
    pairs: torch.Tensor
    pair_push: torch.Tensor | None = None


@dataclass
class LossOutput:
    """What every objective returns for one micro-batch.

    Attributes:
        loss: Scalar to back-propagate; the micro-batch shares of a step sum to the full-batch loss.
        stats: Detached scalars under their logged names, each the micro-batch's share of the step: a step's value
            is the sum over its micro-batches and processes.
        rows: Per-completion diagnostics.
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: RowDiagnostics | None = None
