"""A training step mines its pairs once: ``step_context`` mines them, and each micro-batch finds its groups' there."""

import pytest
import torch

from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages, mine_pairs
from amir_lightning.objectives import pairs as pairs_module
from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings

G, B, T = 4, 6, 5


def make_step(seed: int = 0) -> dict[str, torch.Tensor]:
    """B groups of G completions: ragged lengths, tied rewards, and a group with a NaN reward."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B * G,), generator=gen)
    rewards = torch.randint(0, 3, (B * G,), generator=gen).float() * 0.5
    rewards[G] = float("nan")  # group 1 forms no pair
    rewards[2 * G : 3 * G] = rewards[4 * G : 5 * G]  # two groups with the same rewards
    return {
        "mask": (torch.arange(T) < lengths.unsqueeze(1)).long(),
        "rewards": rewards,
        "logps": -torch.rand(B * G, T, generator=gen) * 3,
    }


LOSSES = {
    "grpo": lambda: GRPOLoss(),
    "amir": lambda: AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.5, max=1.0)),
    "amir_top1_capped": lambda: AmirGRPOLoss(pair_term=PairTermSettings(mode="top1", max_per_group=2, margin=0.25)),
}


@pytest.fixture
def mined_rows(monkeypatch) -> list[int]:
    """The rows of every mining (each checks its groups once), in order."""
    rows: list[int] = []
    check = pairs_module._check_groups

    def counting(rewards: torch.Tensor, group_size: int) -> None:
        rows.append(rewards.numel())
        check(rewards, group_size)

    monkeypatch.setattr(pairs_module, "_check_groups", counting)
    return rows


def train_step(loss: GRPOLoss, step: dict[str, torch.Tensor], micro_batches: int) -> list:
    """One step as training runs it: the step's context, then the loss of each micro-batch of whole groups."""
    context = loss.step_context(step["mask"].sum(-1), step["rewards"], G)
    advantages = group_advantages(step["rewards"], G)
    per = B * G // micro_batches
    outputs = []
    for start in range(0, B * G, per):
        rows = slice(start, start + per)
        batch = (step["logps"][rows], step["mask"][rows], advantages[rows], step["rewards"][rows])
        outputs.append(loss(*batch, G, context=context))
    return outputs


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_training_step_mines_each_group_once(name, micro_batches, mined_rows):
    train_step(LOSSES[name](), make_step(), micro_batches)
    assert mined_rows == [B * G]  # step_context's mining of the whole step, and no other


@pytest.mark.parametrize("name", list(LOSSES))
def test_micro_batches_find_the_pairs_they_would_mine(name):
    loss, step = LOSSES[name](), make_step(seed=3)
    rule = loss.pair_rule
    per = B * G // 3
    for k, out in enumerate(train_step(loss, step, micro_batches=3)):
        rewards = step["rewards"][k * per : (k + 1) * per]
        expected = mine_pairs(rewards, G, rule.margin, rule.mode, rule.max_pairs_per_group)
        assert torch.equal(out.rows.pairs, expected)


def test_a_direct_call_mines_once(mined_rows):
    step = make_step()
    AmirGRPOLoss()(step["logps"], step["mask"], group_advantages(step["rewards"], G), step["rewards"], G)
    assert mined_rows == [B * G]


def test_groups_missing_from_the_step_are_mined():
    """A filler micro-batch (another step's group) or other rewards: its pairs are mined, not found."""
    from amir_lightning.objectives.pairs import PairRule

    mined = PairRule().mine(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    assert mined.find(torch.tensor([0.0, 1.0]), 2) is None
    assert mined.find(torch.tensor([1.0, 0.0]), 4) is None  # another group size
    assert mined.find(torch.tensor([1.0, 0.0], dtype=torch.float64), 2) is None  # another dtype
    found = mined.find(torch.tensor([2.0, 2.0, 1.0, 0.0]), 2)
    assert found is not None and found.pairs().tolist() == [[2, 3]]
    loss = GRPOLoss()
    context = loss.step_context(torch.ones(4), torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    out = loss(torch.zeros(2, 1), torch.ones(2, 1), torch.zeros(2), torch.tensor([0.0, 1.0]), 2, context=context)
    assert out.rows.pairs.tolist() == [[1, 0]]
