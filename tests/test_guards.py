"""Numerical guards: degenerate groups give finite losses; NaN rewards and non-finite steps are never trained on."""

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import build_steps, plan_steps
from amir_lightning.loop.rewarding import RewardGuard, score_completions
from amir_lightning.loop.types import Group, Rollout
from amir_lightning.models import HFModel, build_tiny_model
from amir_lightning.models.policy import ScoringSettings
from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages
from amir_lightning.rewards.base import Reward
from amir_lightning.systems.module import AmirGRPOModule

AGGREGATIONS = ["grpo", "bnpo", "dr_grpo", "dapo"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("case", ["zero_variance", "all_truncated", "empty_completions"])
def test_degenerate_groups_give_finite_loss_and_gradient(aggregation, case):
    logps = -torch.rand(8, 5, requires_grad=True)
    mask = torch.ones(8, 5)
    rewards = torch.tensor([1.0, 0, 1, 0, 2, 2, 2, 2])
    truncated = torch.zeros(8, dtype=torch.bool)
    if case == "zero_variance":
        rewards = torch.full((8,), 0.5)
    elif case == "all_truncated":
        truncated[:] = True
    else:  # completions with no tokens at all (an engine that returned nothing)
        mask[:4] = 0
    adv = group_advantages(rewards, 4)
    for loss in (
        GRPOLoss(aggregation=aggregation, mask_truncated_completions=True, kl_coef=0.1),
        AmirGRPOLoss(aggregation=aggregation, mask_truncated_completions=True, kl_coef=0.1),
    ):
        out = loss(logps, mask, adv, rewards, 4, ref_logps=logps.detach() - 0.1, truncated=truncated)
        (grad,) = torch.autograd.grad(out.loss, logps)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v).all() for v in out.stats.values())


class NaNReward(Reward):
    """Returns NaN for every second completion: a buggy user reward."""

    def score(self, completions, answers):
        return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]


def test_nan_rewards_are_counted_and_their_groups_carry_no_signal():
    completions = [[Completion([1], "1", [0.0], "stop") for _ in range(4)] for _ in range(2)]
    prompts = [Prompt("q", "1"), Prompt("q", "1")]
    total, metrics, _, _ = score_completions([NaNReward()], prompts, completions)
    assert metrics["rollout/nonfinite_rewards"] == 4 and metrics["rollout/nonfinite/na_n"] == 4
    assert math.isfinite(metrics["rollout/reward_mean"])
    advantages = group_advantages(total, 4).nan_to_num(nan=0.0)
    assert torch.equal(advantages, torch.zeros(8))
    loss = AmirGRPOLoss()(-torch.rand(8, 3, requires_grad=True), torch.ones(8, 3), advantages, total, 4)
    assert torch.isfinite(loss.loss) and loss.stats["amir/num_pairs"] == 0


@pytest.mark.parametrize("drop_zero_std", [False, True])
def test_a_group_with_a_nan_reward_is_not_trained_on_nor_counted_in_the_normalisers(drop_zero_std):
    """4 groups, the last with a NaN reward: the step trains on the 3 others with the gradient they get alone. Counted
    in the step (NaN != NaN, so it never read as "all rewards equal"), it scaled every other group's gradient by 0.75
    (``grpo``: a mean over the step's sequences)."""
    rewards = [torch.tensor([0.0, 1, 0, 1]), torch.tensor([1.0, 2, 3, 4]), torch.tensor([0.0, 0, 1, 0])]
    rewards.append(torch.tensor([1.0, float("nan"), 0, 1]))
    groups = [
        Group([1], [Completion([5, 6], "", [0.0] * 2, "stop")] * 4, r, group_advantages(r, 4).nan_to_num(nan=0.0))
        for r in rewards
    ]
    trained = Rollout(groups, {}).trained_groups(drop_zero_std)
    assert trained == groups[:3]
    logps = -torch.rand(16, 2, dtype=torch.float64)

    def first_group_gradient(kept):
        leaf = logps[: 4 * len(kept)].clone().requires_grad_()
        advantages, total = torch.cat([g.advantages for g in kept]), torch.cat([g.rewards for g in kept])
        out = GRPOLoss()(leaf, torch.ones_like(leaf), advantages.double(), total.double(), 4)
        return torch.autograd.grad(out.loss, leaf)[0][:4]

    torch.testing.assert_close(first_group_gradient(trained), first_group_gradient(groups[:3]), atol=0, rtol=0)
    scale = first_group_gradient(groups) / first_group_gradient(groups[:3])
    assert torch.allclose(scale[scale.isfinite()], torch.tensor(0.75, dtype=torch.float64))  # what counting it did


def test_reward_guard_stops_after_consecutive_bad_rollouts():
    guard = RewardGuard(max_bad_rollouts=2)
    guard.check({"rollout/nonfinite/x": 3.0})
    guard.check({})  # a clean rollout resets the count
    guard.check({"rollout/nonfinite/x": 1.0})
    with pytest.raises(ValueError, match="data.rollout.max_bad_rollouts=2"):
        guard.check({"rollout/nonfinite/x": 1.0})


class PoisonedRollouts(L.LightningDataModule):
    """Fixed groups; the advantages of the steps listed in ``poisoned`` are inf (a corrupted batch)."""

    def __init__(self, poisoned):
        super().__init__()
        self.poisoned = set(poisoned)

    def train_dataloader(self):
        module = self.trainer.lightning_module
        eos = module.policy.tokenizer.eos_token_id
        rewards = torch.tensor([0.0, 1.0, 2.0, 1.0])
        adv = group_advantages(rewards, 4)
        if self.trainer.current_epoch in self.poisoned:
            adv = adv * float("inf")
        group = Group(
            module.policy.tokenizer("3=")["input_ids"],
            [Completion([5, 6, eos], "", [0.0] * 3, "stop")] * 4,
            rewards,
            adv,
            rewards.clone(),
        )
        batches = build_steps(plan_steps([group], 1, 1), module.policy.pad_token_id)
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def fit(model_dir, epochs, poisoned, max_bad_steps=3):
    module = AmirGRPOModule(
        policy=HFModel(str(model_dir)),
        loss=GRPOLoss(),
        max_grad_norm=None,
        scoring=ScoringSettings(entropy=False),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        max_bad_steps=max_bad_steps,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
    )
    trainer.fit(module, PoisonedRollouts(poisoned))
    return module, trainer


def test_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir = build_tiny_model(tmp_path / "model", seed=4)
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    module, trainer = fit(model_dir, epochs=1, poisoned=[0])
    assert trainer.global_step == 0 and module.bad_steps.skipped == 1  # the optimiser never stepped
    assert all(torch.equal(v, start[k]) for k, v in module.model.state_dict().items())
    module, trainer = fit(model_dir, epochs=3, poisoned=[1])
    assert trainer.global_step == 2 and module.bad_steps.skipped == 1
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


def test_consecutive_bad_steps_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir = build_tiny_model(tmp_path / "model", seed=4)
    with pytest.raises(FloatingPointError, match="model.max_bad_steps=2"):
        fit(model_dir, epochs=4, poisoned=[0, 1, 2, 3], max_bad_steps=2)
