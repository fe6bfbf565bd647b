"""The module's log-probs through a real (tiny) model: padding-independent, and micro-batching-independent."""

import pytest
import torch

from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import batch_logps, build_steps, fit_plan, make_batch, plan_steps
from amir_lightning.loop.types import Group
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages
from amir_lightning.objectives.amir import PairWeightSettings
from amir_lightning.systems.module import AmirGRPOModule

G = 4


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)
    mod = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=AmirGRPOLoss(kl_coef=0.0, pair_weight=PairWeightSettings(value=0.5, max=1.0, schedule="fixed")),
        temperature=0.9,
    )
    mod.configure_model()
    return mod


def make_groups(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    eos, groups = module.policy.tokenizer.eos_token_id, []
    for text in ["3=", "12+4=", "7*8-1=", "9="]:
        prompt = module.policy.tokenizer(text)["input_ids"]
        completions = []
        for _ in range(G):
            length = int(torch.randint(1, 6, (1,), generator=gen))
            ids = torch.randint(3, 20, (length,), generator=gen).tolist() + [eos]
            completions.append(Completion(ids, "", [0.0] * len(ids), "stop"))
        rewards = torch.randint(0, 3, (G,), generator=gen).float()
        groups.append(Group(prompt, completions, rewards, group_advantages(rewards, G)))
    return groups


def test_logps_do_not_depend_on_padding(module):
    groups = make_groups(module)
    batch = make_batch(groups, module.policy.pad_token_id)
    logps = batch_logps(module.policy, batch)
    row = 0
    for group in groups:
        for c in group.completions:
            ids = torch.tensor([group.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = module.model(ids).logits[0, len(group.prompt_ids) - 1 : -1] / 0.9
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(group.prompt_ids) :, None]).squeeze(-1)
            torch.testing.assert_close(logps[row, : len(c.token_ids)], expected, atol=1e-5, rtol=1e-5)
            row += 1


def step_gradient(module, groups, micro_batch_groups, micro_batch_tokens=None, count=None):
    module.model.zero_grad(set_to_none=True)
    plan = plan_steps(groups, 1, micro_batch_groups, micro_batch_tokens)
    if count is not None:
        plan = fit_plan(plan, [count])
    (step,) = build_steps(plan, module.policy.pad_token_id)
    context = module.loss.step_context(step.lengths, step.rewards, G)
    for batch in step.micro_batches:
        out, _ = module.compute_loss(batch, context)
        out.loss.backward()
    return torch.cat([p.grad.flatten() for p in module.model.parameters()])


def test_step_gradient_does_not_depend_on_micro_batching(module):
    groups = make_groups(module, seed=1)
    whole = step_gradient(module, groups, micro_batch_groups=4)
    assert whole.abs().sum() > 0
    for micro in (1, 2):
        torch.testing.assert_close(step_gradient(module, groups, micro), whole, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    ("tokens", "count", "sizes"),
    [(1, None, [1, 1, 1, 1]), (80, None, [2, 1, 1]), (10**6, None, [4]), (10**6, 2, [2, 2]), (80, 4, [1, 1, 1, 1])],
)
def test_step_gradient_does_not_depend_on_the_token_budget_or_the_agreed_count(module, tokens, count, sizes):
    """Any split into whole groups (by token budget, sorted by length; then split further to an agreed count)
    makes the same update as the whole step in one micro-batch. ``sizes``: groups per micro-batch."""
    groups = make_groups(module, seed=1)  # padded tokens per group alone: 32, 44, 44, 32
    whole = step_gradient(module, groups, micro_batch_groups=4)
    plan = plan_steps(groups, 1, 4, tokens)
    assert [len(part) for part in (fit_plan(plan, [count]) if count else plan)[0]] == sizes
    torch.testing.assert_close(step_gradient(module, groups, 4, tokens, count), whole, atol=1e-6, rtol=1e-4)


def test_export_weights_match_policy(module):
    with module.policy.export_weights() as named:
        state = dict(named)
    assert set(state) == set(module.model.state_dict())


def test_lora_export_merges_out_of_place(tmp_path):
    from transformers import AutoModelForCausalLM

    from amir_lightning.models import LoraSettings

    model_dir = build_tiny_model(tmp_path / "model", seed=3)
    mod = AmirGRPOModule(policy=HFModel(str(model_dir)), lora=LoraSettings(r=4, alpha=8))
    mod.configure_model()
    with torch.no_grad():
        for name, p in mod.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn_like(p))
    before = {k: v.clone() for k, v in mod.model.state_dict().items()}
    with mod.policy.export_weights() as named:
        merged = dict(named)
    assert all(torch.equal(before[k], v) for k, v in mod.model.state_dict().items())  # no rounding drift
    assert set(merged) == set(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    export = mod.export(tmp_path / "export")
    plain = AutoModelForCausalLM.from_pretrained(export)
    ids = torch.tensor([mod.policy.tokenizer("12+4=33")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, mod.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_policy_whose_config_sets_dropout_trains_the_function_the_engine_samples(tmp_path):
    """A LoRA policy whose config sets attention dropout 0.3 (a float its attention layers read, not a ``Dropout``
    module) computes in train mode what it computes in eval mode, as the engine and the old log-probs do: on-policy
    ratios are exactly 1. With the dropout left on, the same weights gave ratios 0.650-1.621 and clip_frac 0.075.
    LoRA's own dropout is refused at start, naming its key."""
    import json

    from amir_lightning.models import LoraSettings

    model_dir = build_tiny_model(tmp_path / "model", seed=3)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.3}))
    mod = AmirGRPOModule(policy=HFModel(str(model_dir)), lora=LoraSettings(r=4, alpha=8))
    mod.configure_model()
    with torch.no_grad():
        for name, p in mod.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))  # adapters that matter
    batch = make_batch(make_groups(mod), mod.policy.pad_token_id)
    old = batch_logps(mod.policy, batch)  # eval mode: the old policy's log-probs
    assert mod.model.training  # restored
    with torch.no_grad():
        trained = mod.policy.completion_logps(
            mod.model, batch.input_ids, batch.attention_mask, batch.completion_width, mod.temperature
        )[0]  # train mode, as the step
    torch.testing.assert_close(trained, old, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"model\.lora\.dropout 0\.3: must be 0"):
        LoraSettings(r=4, alpha=8, dropout=0.3)


def test_full_fine_tuning_does_not_decay_biases_and_norm_weights(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", seed=3)
    mod = AmirGRPOModule(
        policy=HFModel(str(model_dir)), optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    )
    mod.configure_model()
    decayed, flat = mod.configure_optimizers().param_groups
    assert decayed["weight_decay"] == 0.1 and flat["weight_decay"] == 0.0
    names = {id(p): n for n, p in mod.model.named_parameters()}
    assert {names[id(p)].rsplit(".", 1)[0].rsplit(".", 1)[-1] for p in flat["params"]} >= {"norm", "input_layernorm"}
    assert all("bias" in names[id(p)] or "norm" in names[id(p)] for p in flat["params"])
    assert all(p.ndim == 2 for p in decayed["params"])


def test_packed_micro_batches_make_the_same_update_as_padded_ones(module):
    """``model.scoring.packing on`` (one row of real tokens per micro-batch, block-diagonal attention under SDPA)."""
    groups = make_groups(module, seed=3)
    padded = step_gradient(module, groups, micro_batch_groups=2)
    module.policy.packed = True
    try:
        packed = step_gradient(module, groups, micro_batch_groups=2)
    finally:
        module.policy.packed = False
    assert padded.abs().sum() > 0
    torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-4)


def test_packing_auto_follows_the_attention_implementation(tmp_path):
    from amir_lightning.models.scoring import varlen_attention

    model_dir = build_tiny_model(tmp_path / "model", seed=2)
    eager = AmirGRPOModule(
        policy=HFModel(str(model_dir)), scoring=ScoringSettings(attn_implementation="eager", packing="auto")
    )
    eager.configure_model()
    assert eager.model.config._attn_implementation == "eager" and not eager.policy.packed
    forced = AmirGRPOModule(policy=HFModel(str(model_dir)), scoring=ScoringSettings(packing="on"))
    forced.configure_model()
    assert forced.model.config._attn_implementation == "sdpa" and forced.policy.packed
    forced.model.config._attn_implementation = "flash_attention_2"  # what from_pretrained sets where it is installed
    assert varlen_attention(forced.model)
    varlen = AmirGRPOModule(policy=HFModel(str(model_dir)), scoring=ScoringSettings(attn_implementation="varlen"))
    varlen.configure_model()
    assert varlen.model.config._attn_implementation == "varlen" and varlen.policy.packed


def episode_steps(module, seed=0):
    """Episodes with every tool reply after their last policy turn (so the causal model scores the policy tokens of
    both alike), and the same completions without the replies; old and engine log-probs near the policy's own."""
    from helpers.policy_tokens import episode_groups

    data = episode_groups(seed, trailing=True)
    old = {}
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(data.policy_only, module.policy.pad_token_id)
    logps = batch_logps(module.policy, batch)
    rows = [(e, b) for eg, bg in zip(data.episodes, data.policy_only) for e, b in zip(eg.completions, bg.completions)]
    for row, (episode, bare) in enumerate(rows):
        n = len(bare.token_ids)
        before = logps[row, :n] + 0.1 * torch.randn(n, generator=gen)  # the trainer's before this step
        old[id(bare)] = before.tolist()
        bare.sampling_logps = (before + 0.2 * torch.randn(n, generator=gen)).tolist()
        replies = len(episode.token_ids) - n
        old[id(episode)] = old[id(bare)] + [-4.0] * replies
        episode.sampling_logps = bare.sampling_logps + [0.0] * replies
    return data.episodes, data.policy_only, old


def module_step(module, groups, old):
    """The gradient and summed stats of one step of ``groups`` as ``training_step`` runs it (2 micro-batches), with
    the old log-probs ``old`` (by ``id`` of the completion)."""
    from helpers.policy_tokens import put_old_logps

    module.model.zero_grad(set_to_none=True)
    plan = plan_steps(groups, 1, 1)
    (step,) = build_steps(plan, module.policy.pad_token_id)
    for part, batch in zip(plan[0], step.micro_batches):
        put_old_logps(batch, part, old)
    context, stats = module.step_context(step), {}
    for batch in step.micro_batches:
        out, _ = module.compute_loss(batch, context)
        out.loss.backward()
        for key, value in out.stats.items():
            stats[key] = stats.get(key, 0.0) + value.detach()
    return torch.cat([p.grad.flatten() for p in module.model.parameters()]), stats


@pytest.mark.parametrize(
    "loss",
    [GRPOLoss(aggregation="grpo"), GRPOLoss(aggregation="dr_grpo", max_completion_length=30),
     GRPOLoss(aggregation="bnpo", mask_truncated_completions=True), GRPOLoss(aggregation="dapo"),
     AmirGRPOLoss(aggregation="dapo", kl_coef=0.0)],
    ids=["grpo", "dr_grpo", "bnpo mask_truncated", "dapo", "amir dapo"],
)  # fmt: skip
def test_episodes_train_as_their_policy_tokens_through_the_module(module, loss):
    """Through the real forward: a step of episodes (8-token tool replies, masked) makes the update of the same step
    without the replies, and logs the same entropy, clip fractions, engine/trainer KL and importance weights."""
    episodes, bare, old = episode_steps(module)
    own = module.loss
    module.loss = loss
    try:
        ep_grad, ep_stats = module_step(module, episodes, old)
        bare_grad, bare_stats = module_step(module, bare, old)
    finally:
        module.loss = own
    assert bare_grad.abs().sum() > 0 and float(bare_stats["train/clip_frac"]) > 0
    torch.testing.assert_close(ep_grad, bare_grad, atol=1e-6, rtol=1e-4)
    for key in ("train/entropy", "train/clip_frac", "rollout/engine_trainer_kl", "train/is_weight_mean", "train/loss"):
        torch.testing.assert_close(ep_stats[key], bare_stats[key], atol=1e-6, rtol=1e-4, msg=key)


def test_building_the_tiny_model_leaves_the_runs_random_state_alone(tmp_path):
    """A run that builds its model (a cache miss) and one that finds it cached must draw LoRA's adapter init from the
    same random state: before, the build reseeded the global RNG, and a LoRA run resumed with the HF engine (whose
    start does not reseed it, as vLLM's does) trained from other adapters than the uninterrupted run."""
    from safetensors.torch import load_file

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = build_tiny_model(tmp_path / "a", seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    second = build_tiny_model(tmp_path / "b", seed=3)
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # still a function of its seed
