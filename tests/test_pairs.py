"""Pair mining: hand-computed cases and properties (pairs strictly ordered, never across groups)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amir_lightning.objectives import mine_pairs


def as_set(pairs):
    return {tuple(p) for p in pairs.tolist()}


def test_ties_never_pair():
    """[1, 1, 0]: 0 and 1 tie, so only (0, 2) and (1, 2)."""
    assert as_set(mine_pairs(torch.tensor([1.0, 1.0, 0.0]), 3)) == {(0, 2), (1, 2)}


def test_margin_equal_to_gap_is_not_a_pair():
    """Gap 3 - 1 = 2 is not > 2 (strict); margin 1.5 < 2 forms the pair."""
    rewards = torch.tensor([3.0, 1.0])
    assert mine_pairs(rewards, 2, margin=2.0).shape == (0, 2)
    assert as_set(mine_pairs(rewards, 2, margin=1.5)) == {(0, 1)}


def test_official_reward_composition_b7():
    """Official rewards: formatted correct 0.1 + 0.5 + 0.2 + 2.0 = 2.8, formatted wrong 0.1 + 0.5 + 0.2 = 0.8.

    Their gap is exactly 2.0 in float32, so margin 2.0 forms no pair and margin 1.5 does.
    """
    parts = torch.tensor([0.1, 0.5, 0.2, 2.0])
    rewards = torch.stack([parts.sum(), parts[:3].sum()])
    assert mine_pairs(rewards, 2, margin=2.0).numel() == 0
    assert as_set(mine_pairs(rewards, 2, margin=1.5)) == {(0, 1)}


def test_all_equal_group_has_no_pairs():
    assert mine_pairs(torch.full((8,), 0.5), 4).shape == (0, 2)


def test_top1_first_best_against_rest():
    """[1, 3, 3, 0]: the best is index 1 (first of the tie at 3); it pairs with 0 and 3, not with its tie 2."""
    assert as_set(mine_pairs(torch.tensor([1.0, 3.0, 3.0, 0.0]), 4, mode="top1")) == {(1, 0), (1, 3)}


def test_cap_keeps_largest_gaps():
    """[3, 2, 1, 0]: gaps (0,3)=3, (0,2)=2, (1,3)=2, (0,1)=1, (1,2)=1, (2,3)=1.

    Cap 1 -> (0,3); cap 3 -> (0,2), (0,3), (1,3) (listed in index order).
    """
    rewards = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert mine_pairs(rewards, 4, max_pairs_per_group=1).tolist() == [[0, 3]]
    assert mine_pairs(rewards, 4, max_pairs_per_group=3).tolist() == [[0, 2], [0, 3], [1, 3]]
    assert len(mine_pairs(rewards, 4, max_pairs_per_group=100)) == 6


def test_cap_with_top1_and_second_group_offsets():
    """Group 2 = [0, 5, 1] at offset 3: top1 pairs (4, 3) gap 5 and (4, 5) gap 4; cap 1 keeps (4, 3)."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 5.0, 1.0])
    assert mine_pairs(rewards, 3, mode="top1", max_pairs_per_group=1).tolist() == [[4, 3]]


def test_group_with_a_nan_reward_forms_no_pair():
    """[nan, 1, 0, 0] would pair (1, 2) and (1, 3) among its finite members; the group carries no signal instead
    (its advantages are zero), and the next group still pairs."""
    rewards = torch.tensor([float("nan"), 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    assert as_set(mine_pairs(rewards, 4)) == {(4, 5), (4, 6), (4, 7)}
    assert as_set(mine_pairs(rewards, 4, mode="top1")) == {(4, 5), (4, 6), (4, 7)}


@pytest.mark.parametrize("bad", [{"margin": -0.1}, {"mode": "topk"}, {"max_pairs_per_group": 0}])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        mine_pairs(torch.zeros(4), 2, **bad)


def brute_force(rewards, group_size, margin, mode):
    out = set()
    for start in range(0, len(rewards), group_size):
        idx = range(start, start + group_size)
        best = max(idx, key=lambda k: (rewards[k], -k))
        for i, j in itertools.permutations(idx, 2):
            if rewards[i] - rewards[j] > margin and (mode == "all" or i == best):
                out.add((i, j))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(2, 8),
    st.data(),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.sampled_from(["all", "top1"]),
)
def test_pairs_match_brute_force_and_stay_in_group(num_groups, group_size, data, margin, mode):
    values = data.draw(
        st.lists(
            st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.8]),
            min_size=num_groups * group_size,
            max_size=num_groups * group_size,
        )
    )
    rewards = torch.tensor(values)
    pairs = mine_pairs(rewards, group_size, margin=margin, mode=mode)
    assert as_set(pairs) == brute_force(rewards.tolist(), group_size, margin, mode)
    assert len(as_set(pairs)) == len(pairs)  # no duplicates
    if len(pairs):
        assert torch.equal(pairs[:, 0] // group_size, pairs[:, 1] // group_size)
        assert (rewards[pairs[:, 0]] - rewards[pairs[:, 1]] > margin).all()
    if len(set(values)) == 1:
        assert len(pairs) == 0
