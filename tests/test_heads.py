"""LM heads that do more than ``hidden @ W.T`` are never fused: the trainer's log-probs are the model's own.

The fused path (``models/scoring.py``) multiplies the decoder's output by the head's weight itself. Granite and
HyperCLOVAX scale the logits (``logits_scaling``), FalconH1 multiplies them (``lm_head_multiplier``), MiniCPM3 scales
the hidden states first, Gemma 2/3/3n cap them (``final_logit_softcapping``, in the text configuration for
Gemma-3n): fused, their log-probs would come from another distribution than the one the engine samples.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    FalconH1Config,
    Gemma3nConfig,
    Gemma3nTextConfig,
    GraniteConfig,
    HyperCLOVAXConfig,
    MiniCPM3Config,
    Qwen2Config,
)

from amir_lightning.models import HFModel
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.models.scoring import completion_logps, fused_head, head_matches_logits, scaled_head_keys
from amir_lightning.systems.module import AmirGRPOModule

SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip

SCALED = {
    "granite": (GraniteConfig, dict(logits_scaling=4.0), "logits_scaling"),
    "hyperclovax": (HyperCLOVAXConfig, dict(logits_scaling=0.5), "logits_scaling"),
    "falcon_h1": (
        FalconH1Config,
        dict(lm_head_multiplier=2.0, mamba_d_state=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64),
        "lm_head_multiplier",
    ),
    "minicpm3": (
        MiniCPM3Config,
        dict(
            num_key_value_heads=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32,
        ),
        "dim_model_base",
    ),  # fmt: skip
    "gemma3n": (
        Gemma3nTextConfig,
        dict(
            final_logit_softcapping=5.0,
            num_kv_shared_layers=0,
            laurel_rank=8,
            hidden_size_per_layer_input=8,
            layer_types=["full_attention"] * 2,
            activation_sparsity_pattern=[0.0, 0.0],
            head_dim=32,
        ),
        "final_logit_softcapping",
    ),  # fmt: skip
}


def save_tiny(tmp_path, config_cls, extra):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**(SHAPE | extra)))
    model.save_pretrained(tmp_path)
    return tmp_path


def model_logps(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", list(SCALED))
def test_a_scaled_head_falls_back_to_the_models_own_logits(tmp_path, arch, caplog):
    config_cls, extra, key = SCALED[arch]
    module = AmirGRPOModule(policy=HFModel(str(save_tiny(tmp_path, config_cls, extra))))
    module.configure_model()
    assert not module.policy.fused and key in caplog.text  # said once, naming the key
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    expected = model_logps(module.model, ids)[:, -6:]
    with torch.no_grad():
        ours = completion_logps(module.model, ids, mask, 6, fused=module.policy.fused)[0]
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert head_matches_logits(module.model)[2] > 1e-3  # what fusing it would cost (benchmarks/fused_head.py)


def test_a_head_that_scales_without_a_configuration_key_is_caught_by_the_numeric_check():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE, tie_word_embeddings=False)).eval()
    assert head_matches_logits(model)[:2] == (True, 0.0)
    model.lm_head.register_forward_hook(lambda _m, _a, out: out * 1.5)  # a custom head, no key says so
    matches, relative, logps = head_matches_logits(model)
    assert fused_head(model) is not None and not matches and relative == pytest.approx(1 / 3, rel=1e-4)
    assert logps > 1e-2


def test_gemma3n_caps_its_logits_in_the_text_configuration():
    config = Gemma3nConfig()
    assert getattr(config, "final_logit_softcapping", None) is None  # not on the top-level configuration
    assert scaled_head_keys(config) == ["final_logit_softcapping"]


def test_packing_on_is_refused_for_a_head_the_fused_path_cannot_take(tmp_path):
    config_cls, extra, _ = SCALED["granite"]
    module = AmirGRPOModule(
        policy=HFModel(str(save_tiny(tmp_path, config_cls, extra))), scoring=ScoringSettings(packing="on")
    )
    with pytest.raises(ValueError, match="model.scoring.packing: on needs the fused LM head.*logits_scaling"):
        module.configure_model()
