"""bf16 compute with float32 trainable weights: LoRA updates at RL learning rates survive, whatever trainer.precision
says; unsupported precisions and strategies are refused in one line."""

import lightning as L
import pytest
import torch
from helpers.dp_step import FixedRollouts

from amir_lightning.models import HFModel, LoraSettings, build_tiny_model
from amir_lightning.models.export import ExportSettings
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.models.scoring import completion_logps
from amir_lightning.objectives import GRPOLoss
from amir_lightning.systems.module import AmirGRPOModule
from amir_lightning.systems.precision import check_strategy, compute_dtype


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 128 with 4 heads: LoRA A rows have 128 inputs, |A| ~ 0.01-0.1 as in a real model's adapters
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=128, num_heads=4, seed=7)


def train_lora(model_dir, precision, trainable_dtype="float32", steps=20, export_dir=None):
    """qwen.yaml's precision settings (bf16 frozen base, LoRA r 16 on every linear layer, AdamW lr 5e-6)."""
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=GRPOLoss(),
        dtype="bfloat16",
        trainable_dtype=trainable_dtype,
        lora=LoraSettings(r=16, alpha=16),
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-6, betas=(0.9, 0.99), weight_decay=0.1),
        max_grad_norm=0.1,
        scoring=ScoringSettings(entropy=False),
        export=ExportSettings(dir=str(export_dir or model_dir.parent / "export")),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
    )
    module.configure_model()  # build it early to record the initial adapters (configure_model then keeps it)
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters() if "lora_A" in n}
    trainer.fit(module, FixedRollouts())
    after = {n: p.detach().float() for n, p in module.model.named_parameters() if "lora_A" in n}
    changed = sum(int((after[n] != before[n]).sum()) for n in before) / sum(v.numel() for v in before.values())
    return module, changed


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lora_updates_at_rl_learning_rates_survive_bf16(model_dir, precision):
    module, changed = train_lora(model_dir, precision)
    assert module.compute_dtype == torch.bfloat16
    dtypes = {(p.requires_grad, p.dtype) for p in module.model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}  # adapters fp32, frozen base bf16
    assert changed >= 0.99


def test_bf16_trainable_weights_only_by_name_and_then_updates_round_away(model_dir):
    module, changed = train_lora(model_dir, "bf16-mixed", trainable_dtype="bfloat16")
    assert {p.dtype for p in module.model.parameters() if p.requires_grad} == {torch.bfloat16}
    assert changed < 0.5  # what bf16-true did to every run before: most updates are below half an ulp


def test_bf16_compute_runs_the_forward_in_bf16(model_dir):
    module, _ = train_lora(model_dir, "bf16-mixed", steps=1)
    ids = torch.tensor([module.policy.tokenizer("12+4=")["input_ids"]])
    with module.policy.compute_context():
        logits = module.model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16


def test_full_fine_tuning_keeps_float32_weights_under_bf16_compute(model_dir):
    export = str(model_dir.parent / "export_full")
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=GRPOLoss(),
        scoring=ScoringSettings(entropy=False),
        export=ExportSettings(dir=export),
    )
    trainer = L.Trainer(accelerator="cpu", precision="bf16-true", max_steps=1, logger=False, enable_checkpointing=False)
    trainer.fit(module, FixedRollouts())
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}
    ids = torch.tensor([module.policy.tokenizer("12+4=")["input_ids"]])
    with module.policy.compute_context():
        assert module.model(input_ids=ids).logits.dtype == torch.bfloat16


def test_unsupported_precision_and_strategies_are_refused():
    assert compute_dtype("32-true") == torch.float32 and compute_dtype("bf16-true") == torch.bfloat16
    with pytest.raises(ValueError, match="trainer.precision='16-mixed' is not supported: use 32-true"):
        compute_dtype("16-mixed")
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    check_strategy(ModelParallelStrategy())
    with pytest.raises(ValueError, match="FSDPStrategy is not supported: use lightning.pytorch.strategies.ModelPara"):
        check_strategy(FSDPStrategy())


def test_the_compute_dtype_is_chosen_once_per_trainer(model_dir):
    """``validate`` then ``fit`` (``--validate_before_fit``) set the module up twice on one trainer; after the first
    setup replaced the precision plugin, ``trainer.precision`` reads ``32-true``, and the fit still computes in bf16."""
    module = AmirGRPOModule(policy=HFModel(str(model_dir)), loss=GRPOLoss(), scoring=ScoringSettings(entropy=False))
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False)
    module.trainer = trainer
    module.setup("validate")
    assert module.compute_dtype == torch.bfloat16 and trainer.precision == "32-true"
    module.compute_dtype = None
    module.setup("fit")
    assert module.compute_dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_reference_copy_scores_as_the_policy_at_step_zero(model_dir, precision):
    """Full fine-tuning with a KL term: the frozen reference copy and the policy hold the same weights at step 0, so
    their log-probs are the same (a bf16 copy under a float32 policy's autocast differed: a KL floor at step 0)."""
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)), loss=GRPOLoss(kl_coef=0.04), scoring=ScoringSettings(entropy=False)
    )
    module.compute_dtype = compute_dtype(precision)
    module.configure_model()
    ids = torch.randint(3, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), module.policy.compute_context(), module.policy.reference() as reference:
        policy = completion_logps(module.model, ids, torch.ones_like(ids), 8)[0]
        ref = completion_logps(reference, ids, torch.ones_like(ids), 8)[0]
    torch.testing.assert_close(ref, policy, rtol=0, atol=1e-6)


def test_the_precision_is_checked_as_given_with_lightnings_older_names():
    """The CLI checks ``trainer.precision`` before the engine starts (``check_precision``): Lightning's older names
    are read as Lightning reads them, so ``bf16`` and ``32`` pass and ``16`` is refused as ``16-mixed``."""
    from amir_lightning.systems.precision import check_precision

    for given in (None, 32, "32", "32-true", "bf16", "bf16-mixed", "bf16-true"):
        check_precision(given)
    for given, read in ((16, "16-mixed"), ("16-true", "16-true"), ("64", "64-true")):
        with pytest.raises(ValueError, match=f"trainer.precision='{read}' is not supported"):
            check_precision(given)
