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


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl 0.9's ``masked_whiten`` (``verl/utils/torch_functional.py``), written here from its formula in float64:
    the masked mean, the masked variance times ``n / (n - 1)``, and ``(values - mean) * rsqrt(var + 1e-8)``."""
    values, mask = values.double(), mask.double()
    mean = (values * mask).sum() / mask.sum()
    variance = ((values - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def tokens_of(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A response mask ``[N, T]`` of ``lengths``, and the lengths as a tensor."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    return mask, torch.tensor(lengths, dtype=torch.float64)


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_whitens_over_the_batchs_tokens_as_verls_outcome_estimators(estimator):
    """verl's ``compute_reinforce_plus_plus_outcome_advantage`` (gamma 1, the reward on the last token: every token's
    return is the reward) and ``..._baseline_outcome_advantage`` (the group mean subtracted first), whitened over the
    response mask: each completion's advantage is its tokens' value, longer completions weighing more."""
    from amir_lightning.objectives.advantages import estimate_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0])
    lengths = [3, 7, 2, 5, 1, 4]
    mask, tokens = tokens_of(lengths)
    scores = rewards.double()
    if estimator == "reinforce_pp_baseline":
        scores = (scores.view(-1, 2) - scores.view(-1, 2).mean(1, keepdim=True)).view(-1)
    per_token = verl_masked_whiten(scores[:, None] * mask, mask)  # [N, T]
    expected = per_token[:, 0]  # every trained token of a completion carries the same value
    got = estimate_advantages(rewards, 2, estimator, tokens=tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    float64 = estimate_advantages(rewards.double(), 2, estimator, tokens=tokens)
    assert (float64 - expected).abs().max().item() < 1e-12
    if estimator == "reinforce_pp_baseline":
        assert float64[2] == float64[3] != 0.0  # an all-equal group is not zero once the batch is centred (verl's)


def test_reinforce_pp_statistics_span_every_process():
    """Two processes whiten with the statistics of both: each equals the whitening of the concatenated batch."""
    from amir_lightning.objectives.advantages import estimate_advantages

    mine, theirs = torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0.0, 0.0, 2.0, 5.0])
    my_tokens, their_tokens = torch.tensor([2.0, 4.0, 1.0, 3.0]), torch.tensor([6.0, 1.0, 2.0, 2.0])

    def both(stats: torch.Tensor) -> torch.Tensor:
        x, n = theirs.double(), their_tokens.double()
        return stats + torch.stack([n.sum(), (n * x).sum(), (n * x * x).sum()])

    alone = estimate_advantages(
        torch.cat([mine, theirs]), 2, "reinforce_pp", tokens=torch.cat([my_tokens, their_tokens])
    )
    spanning = estimate_advantages(mine, 2, "reinforce_pp", tokens=my_tokens, all_reduce=both)
    torch.testing.assert_close(spanning, alone[:4], atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_rloo_subtracts_the_mean_of_the_groups_other_completions(scale):
    """RLOO (arXiv 2402.14740): r_i - mean of the other G - 1 rewards of its group, in float64 against a loop
    over the completions; then scaled as GRPO's advantages are; an all-equal group is exactly 0."""
    from amir_lightning.objectives.advantages import estimate_advantages

    generator = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=generator, dtype=torch.float64)
    rewards[4:8] = 0.25  # an all-equal group
    G = 4
    expected = torch.empty_like(rewards)
    for i in range(rewards.numel()):
        group = rewards[(i // G) * G : (i // G + 1) * G]
        others = torch.cat([group[: i % G], group[i % G + 1 :]])
        expected[i] = rewards[i] - others.mean()
    if scale == "group":
        expected = expected / (rewards.view(-1, G).std(dim=1).repeat_interleave(G) + 1e-4)
    elif scale == "batch":
        expected = expected / (rewards.std() + 1e-4)
    expected[4:8] = 0.0
    got = estimate_advantages(rewards, G, "rloo", scale)
    assert (got - expected).abs().max().item() < 1e-12
    assert torch.equal(got[4:8], torch.zeros(4, dtype=torch.float64))
    if scale == "none":  # G / (G - 1) times GRPO's centred rewards
        torch.testing.assert_close(got, estimate_advantages(rewards, G, "grpo", "none") * G / (G - 1))


def test_an_estimator_and_a_scale_that_do_not_go_together_are_one_line_naming_the_keys():
    from amir_lightning.loop.collect import RolloutSettings

    with pytest.raises(ValueError, match=r"data.rollout.advantage_scale does not apply to advantage_estimator "
                                         r"reinforce_pp: it standardises over the batch's tokens itself"):  # fmt: skip
        RolloutSettings(advantage_estimator="reinforce_pp", advantage_scale="group")
    with pytest.raises(ValueError, match=r"data.rollout.advantage_estimator must be one of grpo, rloo, reinforce_pp, "
                                         r"reinforce_pp_baseline, got 'gae'"):  # fmt: skip
        RolloutSettings(advantage_estimator="gae")
    assert RolloutSettings().scale == "group" and RolloutSettings(advantage_estimator="rloo").scale == "none"
    assert RolloutSettings(advantage_estimator="rloo", advantage_scale="batch").scale == "batch"


def test_a_rollouts_advantages_come_from_its_estimator_with_each_completions_trained_tokens():
    """``make_rollout`` with ``reinforce_pp``: the tokens are each completion's own (a tool's reply excluded)."""
    from amir_lightning.data.base import Prompt
    from amir_lightning.engines.base import Completion
    from amir_lightning.loop.collect import RolloutSettings, make_rollout
    from amir_lightning.objectives.advantages import estimate_advantages
    from amir_lightning.rewards.base import Reward

    class Length(Reward):
        def score(self, completions, answers, **kwargs):
            return [float(len(c)) for c in completions]

    texts = [["a", "bbb"], ["cc", "dddd"]]
    completions = [[Completion(list(range(len(t))), t, [0.0] * len(t), "stop") for t in group] for group in texts]
    settings = RolloutSettings(group_size=2, prompts_per_process=2, advantage_estimator="reinforce_pp")
    rollout = make_rollout([Prompt("p", ""), Prompt("q", "")], [[1], [2]], completions, 0.1, [Length()], settings)
    rewards = torch.tensor([1.0, 3.0, 2.0, 4.0])
    expected = estimate_advantages(rewards, 2, "reinforce_pp", tokens=torch.tensor([1.0, 3.0, 2.0, 4.0]))
    got = torch.cat([group.advantages for group in rollout.groups])
    torch.testing.assert_close(got, expected)
