"""On one CUDA GPU: the paper's setting (configs/qwen.yaml) at the paper's model size, and a tiny FSDP2 run that learns.

Skipped without CUDA. No vLLM and no hub are needed: the rollout engine is ``HFEngine`` and the models are random
(a Qwen2.5-3B-shaped one built from its config). Sized to finish in under 5 minutes on one H200; docs/gpu.md says
how to run them on a bare CUDA machine with no internet.
"""

import functools
import json
from pathlib import Path

import pytest
from conftest import read_scalars, run_amir
from helpers.qwen_setting import check_qwen_run, qwen_setting_args, tiny_policy

from amir_lightning.models import QWEN25_3B_SHAPE
from amir_lightning.models.policy import ScoringSettings

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).parents[2]


def hf_engine(batch_size: int) -> str:
    init = {"dtype": "bfloat16", "batch_size": batch_size, "progress": False}
    return json.dumps({"class_path": "amir_lightning.engines.HFEngine", "init_args": init})


def test_qwen_setting_at_the_paper_size(tmp_path):
    """qwen.yaml (FSDP2, bf16 compute with float32 LoRA adapters, gradient checkpointing, exact sync check) on a
    random model of Qwen2.5-3B's shape: 3 rollouts of 4 prompts x 8, every sync verified, the export loads."""
    policy = tiny_policy(**QWEN25_3B_SHAPE, dtype="bfloat16")
    extra = ["--data.engine", hf_engine(32), "--data.sampling.max_new_tokens", "128"]
    run_amir(qwen_setting_args(policy, "gpu", 1, rollouts=3, extra=extra), tmp_path, timeout=420)
    check_qwen_run(tmp_path / "runs" / "qwen" / "version_0", rollouts=3)


def test_tiny_fsdp2_run_learns(tmp_path):
    """configs/tiny.yaml under ModelParallelStrategy (FSDP2) on one GPU: the copy-a-digit reward rises."""
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--trainer.accelerator",
        "gpu",
        "--trainer.strategy",
        "{class_path: lightning.pytorch.strategies.ModelParallelStrategy}",
        "--data.engine",
        hf_engine(128),
        "--trainer.max_epochs",
        "20",
    ]
    run_amir(args, tmp_path, timeout=300)
    rewards = read_scalars(tmp_path / "runs" / "tiny" / "version_0")["rollout/reward_mean"]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.1


def test_varlen_packing_matches_padded_sdpa(tmp_path, monkeypatch):
    """``attn_implementation: varlen`` with ``packing: auto`` on CUDA: PyTorch's variable-length flash kernel runs
    (once per layer), and the packed log-probs and LoRA gradients equal SDPA's on the padded rows (bf16 tolerance)."""
    import torch
    import torch.nn.attention.varlen as varlen_module

    from amir_lightning.models import HFModel, LoraSettings, build_tiny_model
    from amir_lightning.models.scoring import completion_logps
    from amir_lightning.systems.module import AmirGRPOModule

    model_dir = build_tiny_model(tmp_path / "model", hidden_size=256, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    calls = []
    kernel = varlen_module.varlen_attn

    @functools.wraps(kernel)  # the keywords are read from the kernel's signature (models/attention.py)
    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attn", counted)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (6, 40), generator=gen).cuda()
    mask = torch.ones_like(ids)
    for row in range(6):
        mask[row, : row * 2] = 0  # left padding of the prompt
        mask[row, 40 - row * 3 :] = 0  # right padding of the completion
    results = {}
    for attention in ("sdpa", "varlen"):
        module = AmirGRPOModule(
            policy=HFModel(str(model_dir)),
            lora=LoraSettings(r=8),
            scoring=ScoringSettings(attn_implementation=attention),
        )
        module.compute_dtype = torch.bfloat16
        torch.manual_seed(1)  # the same adapters in both: lora_A at creation, lora_B below
        module.configure_model()
        module.to("cuda")
        for name, p in module.model.named_parameters():  # the same non-zero adapters in both
            if "lora_B" in name:
                p.data.normal_(0, 0.02)
        calls.clear()

        with torch.autocast("cuda", dtype=torch.bfloat16):
            logps, _ = completion_logps(module.model, ids, mask, 20, 0.9, packed=module.policy.packed)
        logps.sum().backward()
        grads = {n: p.grad.float().clone() for n, p in module.model.named_parameters() if p.grad is not None}
        results[attention] = (logps.detach().float(), grads, module.policy.packed, len(calls))
    (ref, ref_grads, ref_packed, _), (out, grads, packed, kernel_calls) = results["sdpa"], results["varlen"]
    assert not ref_packed and packed and kernel_calls == 2  # 2 layers, one packed row
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-2)
    for name in ref_grads:
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=5e-2 * scale + 1e-6, msg=name)


def test_sleep_mode_frees_the_engines_memory_and_wakes_with_its_weights(tmp_path):
    """A colocated vLLM engine with ``enable_sleep_mode`` gives its GPU memory back after a rollout (its weights go to
    CPU memory, its KV cache is dropped) and, woken by its next use, samples as before (needs vLLM on the machine)."""
    pytest.importorskip("vllm")
    import torch

    from amir_lightning.engines import SamplingConfig, VLLMEngine
    from amir_lightning.models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=1)
    kv_cache = 1024**3
    engine = VLLMEngine(max_model_len=64, kv_cache_memory_bytes=kv_cache, progress=False, enable_sleep_mode=True)
    engine.start(model_dir, seed=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(0)
    before = engine.generate([[5, 6, 7]], 4, sampling)
    awake_free = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.asleep and torch.cuda.mem_get_info()[0] - awake_free > 0.9 * kv_cache
    torch.manual_seed(0)
    after = engine.generate([[5, 6, 7]], 4, sampling)  # wakes first
    assert not engine.asleep
    assert [c.token_ids for c in before[0]] == [c.token_ids for c in after[0]]
