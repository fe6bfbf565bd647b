"""The fused log-prob path (LM head + log-softmax in chunks, recomputed in the backward) equals the materialised one."""

import pytest
import torch

from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.scoring import completion_logps
from amir_lightning.module import AmirGRPOModule
from amir_lightning.objectives import selective_log_softmax
from amir_lightning.objectives.logprobs import chosen_token_logps


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
def test_a_policy_scores_the_same_fused_or_materialised(model_dir, lora):
    """Whole forward and backward through a tiny Qwen2 (with LoRA too): log-probs, entropies and every gradient."""
    from amir_lightning.models.loading import LoraSettings

    module = AmirGRPOModule(policy=HFModel(str(model_dir)), lora=LoraSettings(r=4) if lora else None)
    module.configure_model()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 20, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the prompt
    mask[1, -3:] = 0  # right padding of the completion
    results = []
    for fused in (True, False):
        module.policy.zero_grad(set_to_none=True)
        logps, entropy = completion_logps(module.policy, ids, mask, 5, 0.8, chunk_size=4, entropy=True, fused=fused)
        (logps * torch.linspace(-1, 1, 5)).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
        results.append((logps.detach(), entropy, grads))
    (fused_logps, fused_entropy, fused_grads), (ref_logps, ref_entropy, ref_grads) = results
    assert fused_logps[1, -3:].eq(0).all() and ref_logps[1, -3:].eq(0).all()  # padding scores nothing
    torch.testing.assert_close(fused_logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == ref_grads.keys() and len(fused_grads) > 0
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
