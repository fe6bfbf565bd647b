"""The fused log-prob path (LM head + log-softmax in chunks, recomputed in the backward) equals the materialised one."""

import pytest
import torch

from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.attention import register as register_varlen
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.models.scoring import completion_logps
from amir_lightning.objectives import selective_log_softmax
from amir_lightning.objectives.logprobs import chosen_token_logps
from amir_lightning.systems.module import AmirGRPOModule


def materialised(hidden, weight, targets, temperature):
    return selective_log_softmax((hidden @ weight.T)[None], targets[None], temperature)[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_values_and_gradients_match_float32(temperature, chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    upstream = torch.randn(37, generator=gen)
    ours, entropy = chosen_token_logps(hidden, weight, targets, temperature, chunk, entropy=True)
    (ours * upstream).sum().backward()
    ours_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = materialised(hidden, weight, targets, temperature)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grads[1], weight.grad, rtol=1e-5, atol=1e-5)
    logp = torch.log_softmax((hidden @ weight.T).detach() / temperature, -1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_values_and_gradients_match_under_bfloat16_autocast():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=gen, requires_grad=True)
    weight = torch.randn(64, 32, generator=gen) * 0.2
    targets = torch.randint(0, 64, (40,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = chosen_token_logps(hidden, weight, targets, 0.9, chunk_size=8)
        reference = selective_log_softmax(torch.nn.functional.linear(hidden, weight)[None], targets[None], 0.9)[0]
    ours_grad = torch.autograd.grad(ours.sum(), hidden)[0]
    reference_grad = torch.autograd.grad(reference.sum(), hidden)[0]
    assert ours.dtype == torch.float32 and ours_grad.dtype == hidden.dtype
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)  # the same bf16 logits, the same float32 softmax
    torch.testing.assert_close(ours_grad, reference_grad, rtol=2e-2, atol=2e-3)  # bf16 matmuls of the backward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "eager", "varlen"])
def test_a_policy_scores_the_same_fused_packed_or_materialised(model_dir, lora, attention):
    """Whole forward and backward through a tiny Qwen2 (with LoRA too): log-probs, entropies and every gradient, of
    padded rows (fused or materialised head) and of the rows packed into one without padding."""
    from amir_lightning.models.loading import LoraSettings

    module = AmirGRPOModule(policy=HFModel(str(model_dir)), lora=LoraSettings(r=4) if lora else None)
    module.configure_model()
    register_varlen()  # on a CPU, varlen is SDPA: this checks its registration and fallback (the kernel: tests/gpu)
    module.model.config._attn_implementation = attention  # the mask path of each (packed: block-diagonal)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 20, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the prompt
    mask[1, -3:] = 0  # right padding of the completion
    results = {}
    for mode in ("materialised", "fused", "packed"):
        module.model.zero_grad(set_to_none=True)
        fused, packed = mode != "materialised", mode == "packed"
        logps, entropy = completion_logps(module.model, ids, mask, 5, 0.8, 4, True, fused, packed)
        (logps * torch.linspace(-1, 1, 5)).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}
        results[mode] = (logps.detach(), entropy, grads)
    ref_logps, ref_entropy, ref_grads = results["materialised"]
    assert ref_logps[1, -3:].eq(0).all() and len(ref_grads) > 0  # padding scores nothing
    for mode in ("fused", "packed"):
        logps, entropy, grads = results[mode]
        assert logps[1, -3:].eq(0).all()
        torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5, msg=mode)
        torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5, msg=mode)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{mode} {name}")


def test_packing_attends_within_each_sequence_only(model_dir):
    """A packed row's log-probs do not change when another sequence of the pack changes (no attention across)."""
    module = AmirGRPOModule(policy=HFModel(str(model_dir)))
    module.configure_model()
    ids = torch.randint(3, 20, (2, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        first = completion_logps(module.model, ids, mask, 4, packed=True)[0]
        ids[0, :] = torch.randint(3, 20, (8,), generator=torch.Generator().manual_seed(5))
        second = completion_logps(module.model, ids, mask, 4, packed=True)[0]
    assert not torch.equal(first[0], second[0])
    torch.testing.assert_close(second[1], first[1], rtol=0, atol=1e-6)


def test_varlen_offsets_and_the_keywords_of_each_kernel_version():
    from torch.nn.attention.varlen import varlen_attn

    from amir_lightning.models.attention import _kernel_options, packed_starts

    assert packed_starts(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])).tolist() == [0, 3, 5, 6, 10]
    current = {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.125}  # causal
    assert _kernel_options(varlen_attn, 0.125, 64, gqa=True) == current

    def first_release(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...

    assert _kernel_options(first_release, 0.125, 64, gqa=True) == {"is_causal": True}  # kv heads repeated instead
    with pytest.raises(ValueError, match="has no scale"):
        _kernel_options(first_release, 0.2, 64, gqa=False)


def test_packed_scoring_hands_the_sequence_offsets_to_varlen_attention(model_dir, monkeypatch):
    """The offsets of the packed sequences are computed once per forward and reach every layer's attention."""
    from transformers import AttentionInterface

    from amir_lightning.models.attention import varlen_attention_forward

    seen = []

    def spy(*args, **kwargs):
        seen.append((kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")))
        return varlen_attention_forward(*args, **kwargs)

    module = AmirGRPOModule(policy=HFModel(str(model_dir)), scoring=ScoringSettings(attn_implementation="varlen"))
    module.configure_model()  # registers varlen: the spy goes in after
    monkeypatch.setitem(AttentionInterface._global_mapping, "varlen", spy)
    ids = torch.randint(3, 20, (3, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -3:] = 0
    with torch.no_grad():
        completion_logps(module.model, ids, mask, 5, packed=module.policy.packed)
    assert module.policy.packed and len(seen) == 2  # one call per layer
    for offsets, longest in seen:
        assert offsets.tolist() == [0, 7, 13, 22] and longest == 9
