"""Log-probs of given tokens under a causal language model: the one place a policy's forward becomes log-probs.

The trainer (``AmirGRPOModule``), the weight-sync probe and ``HFEngine`` all score through these two functions, so
the numbers they compare come from the same code.
"""

from __future__ import annotations

import torch

from amir_lightning.objectives.logprobs import selective_log_softmax, token_entropy


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    temperature: float = 1.0,
    chunk_rows: int = 4,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, T]`` log-probs of the last ``T = completion_width`` tokens of each row (and their entropies).

    Rows are prompts padded on the left and completions padded on the right; position ids restart at each row's
    first real token, so left padding does not shift the rotary positions. One forward; only the last ``T + 1``
    positions' logits are computed, and their log-softmax is taken ``chunk_rows`` rows at a time.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=completion_width + 1,
        use_cache=False,
    ).logits[:, :-1]  # [n, T, V]
    targets = input_ids[:, -completion_width:]
    logps = selective_log_softmax(logits, targets, temperature, chunk_rows)
    entropies = token_entropy(logits.detach(), temperature, chunk_rows) if entropy else None
    return logps, entropies


@torch.no_grad()
def sequence_token_logps(model, prompt: list[int], completion: list[int], device) -> list[float]:
    """Log-probs at temperature 1 of ``completion``'s tokens after ``prompt`` (one unpadded row, no gradient)."""
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()  # predicts the completion
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu().tolist()
