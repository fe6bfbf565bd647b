"""Log-probs of given tokens under a causal language model: the one place a policy's forward becomes log-probs.

The trainer (``AmirGRPOModule``), the weight-sync probe and ``HFEngine`` all score through these two functions, so
the numbers they compare come from the same code.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch

from amir_lightning.models import attention
from amir_lightning.objectives.logprobs import chosen_token_logps, selective_log_softmax, token_entropy

log = logging.getLogger(__name__)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    temperature: float = 1.0,
    chunk_size: int = 512,
    entropy: bool = False,
    fused: bool = True,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, T]`` log-probs of the last ``T = completion_width`` tokens of each row (and their entropies).

    Rows are prompts padded on the left and completions padded on the right; position ids restart at each row's
    first real token, so left padding does not shift the rotary positions. One forward.

    ``fused`` (where the model allows it: a plain linear LM head, ``fused_head``) takes the decoder's last hidden
    states of the real completion tokens only and fuses the LM head with the log-softmax, ``chunk_size`` tokens at
    a time (``chosen_token_logps``): no ``[n, T, V]`` logits exist, in the forward or for the backward, and padding
    costs nothing past the decoder. Otherwise the last ``T + 1`` positions' logits are computed and their
    log-softmax taken ``max(1, chunk_size // T)`` rows at a time. Padding positions get log-prob 0 (and entropy 0).

    ``packed`` (with the fused head) runs the decoder on one row of every real token back to back, with position ids
    that restart at each sequence and no attention mask: no padding at all. Hugging Face models read the restarts
    as separate sequences (varlen kernels under flash attention; a block-diagonal mask under SDPA and eager).
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_width:]  # [n, T]
    head = fused_head(model) if fused else None
    if head is not None and packed:
        return _packed_completion_logps(
            head, model, input_ids, attention_mask, position_ids, completion_width, temperature, chunk_size, entropy
        )
    if head is None:
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=completion_width + 1,
            use_cache=False,
        ).logits[:, :-1]  # [n, T, V]
        rows = max(1, chunk_size // max(completion_width, 1))
        real = attention_mask[:, -completion_width:].to(torch.float32)
        logps = selective_log_softmax(logits, targets, temperature, rows) * real
        entropies = token_entropy(logits.detach(), temperature, rows) * real if entropy else None
        return logps, entropies
    decoder, weight = head
    hidden = _decoder_output(model, decoder, input_ids, attention_mask, position_ids)
    hidden = hidden[:, -completion_width - 1 : -1]  # [n, T, H]: position t predicts token t + 1
    real = attention_mask[:, -completion_width:].bool()  # [n, T] real completion tokens
    return _scatter(real, *chosen_token_logps(hidden[real], weight(), targets[real], temperature, chunk_size, entropy))


def _packed_completion_logps(
    head, model, input_ids, attention_mask, position_ids, completion_width, temperature, chunk_size, entropy
):
    decoder, weight = head
    tokens = attention_mask.bool()  # [n, W] every real token, prompt and completion
    extra = _sequence_offsets(tokens.sum(-1)) if varlen_attention(model) else {}
    packed_ids, packed_positions = input_ids[tokens][None], position_ids[tokens][None]
    hidden = _decoder_output(model, decoder, packed_ids, None, packed_positions, **extra)[0]  # [L, H]
    flat = torch.full(tokens.shape, -1, dtype=torch.long, device=tokens.device)
    flat[tokens] = torch.arange(int(tokens.sum()), device=tokens.device)  # row position -> packed position
    real = tokens[:, -completion_width:]  # [n, T] real completion tokens; each follows a real token
    before = flat[:, -completion_width - 1 : -1][real]  # [M] packed positions that predict them
    targets = input_ids[:, -completion_width:][real]
    return _scatter(real, *chosen_token_logps(hidden[before], weight(), targets, temperature, chunk_size, entropy))


def _sequence_offsets(lengths: torch.Tensor) -> dict:
    """Flash attention's keyword arguments for a packed row of sequences of ``lengths`` tokens.

    Computed once per forward; without them every layer's varlen kernel would derive them from the position ids,
    a device sync per layer.
    """
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    longest = int(lengths.max())
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def _decoder_output(model, decoder, input_ids, attention_mask, position_ids, **kwargs) -> torch.Tensor:
    """The decoder's last hidden states, caught on their way to the LM head, which computes no position."""
    captured = []
    hook = decoder.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
            use_cache=False,
            **kwargs,
        )
    finally:
        hook.remove()
    return captured[-1]


def _scatter(real: torch.Tensor, picked: torch.Tensor, picked_entropy: torch.Tensor | None):
    """``[M]`` values of the real completion tokens back into ``[n, T]`` (0 at padding)."""
    logps = torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_scatter(real, picked)
    if picked_entropy is None:
        return logps, None
    return logps, torch.zeros_like(logps).masked_scatter(real, picked_entropy)


def varlen_attention(model) -> bool:
    """Whether ``model``'s attention runs packed sequences as separate ones (flash attention, ``varlen``)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return isinstance(implementation, str) and ("flash" in implementation or implementation == attention.NAME)


#: Configuration keys of heads that do more than ``hidden @ W.T``, with the value that leaves the logits as they are:
#: Gemma 2/3/3n softcapping, Cohere's logit_scale, Granite's and HyperCLOVAX's logits_scaling, FalconH1's
#: lm_head_multiplier, MiniCPM's dim_model_base (it scales the hidden states before the head).
SCALED_HEAD_KEYS = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
    "dim_model_base": None,
}


def fused_head(model):
    """``(decoder, weight)`` when the LM head of ``model`` is a plain linear map of the decoder's output, else None.

    ``weight`` is a function giving the head's ``[V, H]`` weight after the forward: whole under FSDP2 too, whatever
    the shard state before the forward (the root module, which holds the head, keeps its parameters gathered
    between forward and backward), so a run takes one path throughout. Heads with a bias, or whose configuration
    (or text configuration) scales or caps the logits (``SCALED_HEAD_KEYS``), are not fused; ``head_matches_logits``
    catches the ones no key names.
    """
    head = _linear_head(model)
    if head is None or scaled_head_keys(getattr(_base(model), "config", None)):
        return None
    return head


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _linear_head(model):
    """``(decoder, weight)`` of a bias-free linear LM head, whatever the configuration says."""
    base = _base(model)
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if get_decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None

    def weight() -> torch.Tensor:
        w = head.weight
        if type(w).__name__ != "DTensor":
            return w
        if w.requires_grad:  # FSDP2 gathers a trainable head for the forward; a shard here would lose its gradient
            raise RuntimeError("the LM head is still sharded after the forward: the fused head cannot train it")
        return w.full_tensor()

    return get_decoder(), weight


def scaled_head_keys(config) -> list[str]:
    """The ``SCALED_HEAD_KEYS`` that ``config`` (or its text configuration) sets to a value that changes the logits."""
    if config is None:
        return []
    configs = [config]
    if hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    return sorted(
        {
            key
            for c in configs
            for key, neutral in SCALED_HEAD_KEYS.items()
            if getattr(c, key, None) is not None and getattr(c, key) != neutral
        }
    )


@torch.no_grad()
def head_matches_logits(model, tokens: int = 8, rtol: float = 1e-4) -> tuple[bool, float, float]:
    """Whether the fused head computes ``model``'s own logits.

    One forward of a short sequence; the decoder's output times the head's weight must equal ``model(...).logits``
    within ``rtol`` of their largest magnitude, and the configuration must name no scaling (``fused_head``). A head
    that scales, caps or shifts its logits in a way no key names fails here, once, instead of training on another
    distribution than the engine samples.

    Returns:
        ``(matches, relative logit difference, largest absolute log-prob difference)``; NaN differences when the
        head is not a linear map at all.
    """
    head = _linear_head(model)
    if head is None:
        return False, float("nan"), float("nan")
    decoder, weight = head
    device = next(model.parameters()).device
    vocab = _base(model).get_output_embeddings().weight.shape[0]  # the whole head's rows (before the forward)
    ids = (torch.arange(tokens, device=device) * 7919 + 11) % vocab  # a fixed sequence of distinct tokens
    captured = []
    hook = decoder.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
    try:
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()  # [tokens, V]
    finally:
        hook.remove()
    fused = torch.nn.functional.linear(captured[-1][0], weight()).float()  # [tokens, V]
    relative = float((fused - logits).abs().max() / logits.abs().max().clamp(min=1e-30))
    logps = float((fused.log_softmax(-1) - logits.log_softmax(-1)).abs().max())
    return relative <= rtol and fused_head(model) is not None, relative, logps


def fused_head_allowed(model, packing_on: bool = False) -> bool:
    """Whether ``model``'s log-probs may take the fused head (``head_matches_logits``); says why not, once.

    ``packing_on`` (``model.scoring.packing: on``, which needs the fused head) turns a refusal into an error.
    """
    matches, difference, _ = head_matches_logits(model)
    if not matches:
        keys = scaled_head_keys(getattr(model, "config", None))
        why = f"its configuration sets {', '.join(keys)}" if keys else f"they differ by {difference:.3g} relative"
        if packing_on:
            raise ValueError(
                f"model.scoring.packing: on needs the fused LM head, and this policy's head is not hidden @ W.T "
                f"({why}); set model.scoring.packing to auto or off"
            )
        log.warning(
            "the policy's LM head does more than hidden @ W.T (%s): its log-probs are taken from the model's own "
            "logits (model.scoring.fused_head falls back to the materialised path, and nothing is packed)",
            why,
        )
    return matches


@torch.no_grad()
def sequence_token_logps(model, prompt: list[int], completion: list[int], device) -> list[float]:
    """Log-probs at temperature 1 of ``completion``'s tokens after ``prompt`` (one unpadded row, no gradient)."""
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()  # predicts the completion
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu().tolist()


def autocast(device: torch.device, dtype: torch.dtype, enabled: bool = True) -> AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``; a no-op for float32 or when not ``enabled``."""
    if not enabled or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
