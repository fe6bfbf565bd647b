"""Group advantages: hand-computed values and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amir_lightning.objectives import group_advantages


def test_hand_computed_group_scale():
    """rewards [1, 0, 0, 1], G = 4: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.577350.

    A = +-0.5 / (0.577350 + 1e-4) = +-0.865875.
    """
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]))


def test_hand_computed_batch_and_none_scale():
    """Two groups [0, 2] and [1, 1]: batch std of [0, 2, 1, 1] = sqrt(2 / 3) = 0.816497.

    batch: group 1 centred [-1, 1] / (0.816497 + 1e-4) = [-1.224556, 1.224556]; group 2 all-equal -> 0.
    none:  [-1, 1, 0, 0].
    """
    rewards = torch.tensor([0.0, 2.0, 1.0, 1.0])
    a = 1 / (math.sqrt(2 / 3) + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 2, scale="batch"), torch.tensor([-a, a, 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(rewards, 2, scale="none"), torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_all_equal_group_is_exactly_zero():
    # 0.1 is not representable: the float mean of three copies is not exactly 0.1, yet advantages must be 0.
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        group_advantages(torch.zeros(8), group_size=3)


rewards_strategy = st.integers(1, 6).flatmap(
    lambda b: st.integers(2, 8).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=b * g, max_size=b * g),
        )
    )
)


@settings(max_examples=200, deadline=None)
@given(rewards_strategy, st.sampled_from(["group", "batch", "none"]))
def test_advantages_finite_and_zero_mean_per_group(case, scale):
    group_size, values = case
    rewards = torch.tensor(values)
    adv = group_advantages(rewards, group_size, scale=scale)
    assert torch.isfinite(adv).all()
    grouped = adv.view(-1, group_size)
    assert grouped.mean(dim=1).abs().max() <= 1e-3 * max(1.0, grouped.abs().max().item())
    equal = rewards.view(-1, group_size)
    flat = equal.amax(1) == equal.amin(1)
    assert torch.equal(grouped[flat], torch.zeros_like(grouped[flat]))


def test_batch_std_spans_every_process_and_skips_nan():
    """Two processes' rollouts [0, 2 | 1, 1] and [4, 4 | 0, 3]: each must divide by the std of all eight rewards,
    not of its own four (which would give the two processes differently scaled advantages)."""
    from amir_lightning.objectives.advantages import batch_std

    mine, theirs = torch.tensor([0.0, 2.0, 1.0, 1.0]), torch.tensor([4.0, 4.0, 0.0, 3.0])

    def other(t):
        return torch.stack(
            [torch.tensor(4.0, dtype=torch.float64), theirs.double().sum(), theirs.double().square().sum()]
        )

    std = batch_std(mine, lambda stats: stats + other(stats))
    assert std == pytest.approx(torch.cat([mine, theirs]).double().std().item(), rel=1e-12)
    expected = (mine.view(2, 2) - mine.view(2, 2).mean(1, keepdim=True)).view(-1) / (std + 1e-4)
    expected[2:] = 0.0  # the all-equal group
    torch.testing.assert_close(group_advantages(mine, 2, scale="batch", std=std), expected)
    with_nan = torch.tensor([0.0, 2.0, float("nan"), 1.0])
    assert batch_std(with_nan) == pytest.approx(torch.tensor([0.0, 2.0, 1.0]).std().item())
    assert group_advantages(with_nan, 2, scale="batch")[:2].isfinite().all()  # one NaN does not poison the batch
