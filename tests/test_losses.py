"""GRPO and AMIR-GRPO losses: hand-computed values for every aggregation mode, clipping, KL, truncation, lambda."""

import math
import re

import pytest
import torch

from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss
from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings

# Two completions of one group: lengths 2 and 3 (T = 3), advantages given directly as +2 and -1.
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([2.0, -1.0])
REWARDS = torch.tensor([1.0, 0.0])


def logps():
    return torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -1.5, -2.5]], requires_grad=True)


@pytest.mark.parametrize(
    ("aggregation", "expected", "grad00"),
    [
        # On-policy the ratio is 1: per-token loss = -A_i -> row 0 [-2, -2], row 1 [1, 1, 1].
        # grpo: mean over sequences of token means = ((-4)/2 + 3/3) / 2 = -0.5; d/dlogp[0,0] = -2 / 2 / 2 = -0.5.
        ("grpo", -0.5, -0.5),
        # bnpo / dapo: token mean = (-4 + 3) / 5 = -0.2; d/dlogp[0,0] = -2 / 5 = -0.4.
        ("bnpo", -0.2, -0.4),
        ("dapo", -0.2, -0.4),
        # dr_grpo with L = 4: (-4 + 3) / (2 * 4) = -0.125; d/dlogp[0,0] = -2 / 8 = -0.25.
        ("dr_grpo", -0.125, -0.25),
    ],
)
def test_aggregation_on_policy(aggregation, expected, grad00):
    lp = logps()
    out = GRPOLoss(aggregation=aggregation, max_completion_length=4)(lp, MASK, ADV, REWARDS, 2)
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    torch.testing.assert_close(lp.grad[0, 0], torch.tensor(grad00))
    assert lp.grad[0, 2] == 0  # padding gets no gradient
    assert out.stats["train/clip_frac"] == 0


def test_clipping_off_policy_token_level():
    """old logps make ratios: row 0 (A=+2) [1.5, 1.0]; row 1 (A=-1) [0.5, 1.0, 1.0].

    Token (0,0): min(1.5 * 2, 1.2 * 2) = 2.4 (clipped high, no gradient).
    Token (1,0): min(0.5 * -1, 0.8 * -1) = -0.8 (clipped low, no gradient).
    grpo loss = (-(2.4 + 2) / 2 + (0.8 + 1 + 1) / 3) / 2 = (-2.2 + 0.933333) / 2 = -0.633333.
    clip fractions over 5 tokens: high 1/5, low 1/5, any 2/5.
    """
    lp = logps()
    old = lp.detach().clone()
    old[0, 0] -= math.log(1.5)
    old[1, 0] -= math.log(0.5)
    out = GRPOLoss(aggregation="grpo")(lp, MASK, ADV, REWARDS, 2, old_logps=old)
    torch.testing.assert_close(out.loss, torch.tensor((-2.2 + 2.8 / 3) / 2))
    out.loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0
    torch.testing.assert_close(lp.grad[0, 1], torch.tensor(-2 / 2 / 2))  # -A * ratio / |o| / N
    torch.testing.assert_close(out.stats["train/clip_frac_high"], torch.tensor(0.2))
    torch.testing.assert_close(out.stats["train/clip_frac_low"], torch.tensor(0.2))
    torch.testing.assert_close(out.stats["train/clip_frac"], torch.tensor(0.4))


def test_epsilon_high_widens_upper_clip():
    """With epsilon_high = 0.6 the ratio 1.5 of token (0,0) is inside [0.8, 1.6] and keeps its gradient."""
    lp = logps()
    old = lp.detach().clone()
    old[0, 0] -= math.log(1.5)
    out = GRPOLoss(epsilon_high=0.6)(lp, MASK, ADV, REWARDS, 2, old_logps=old)
    out.loss.backward()
    torch.testing.assert_close(lp.grad[0, 0], torch.tensor(-2 * 1.5 / 2 / 2))
    assert out.stats["train/clip_frac"] == 0


def test_sequence_importance_sampling():
    """GSPO: row 0 log-ratios [log 1.5, 0] -> sequence ratio exp(log(1.5) / 2) = 1.224745 > 1.2: clipped to 1.2.

    Row 0 per-token loss -min(1.2247 * 2, 1.2 * 2) = -2.4 on both tokens; row 1 on-policy [1, 1, 1].
    grpo loss = (-2.4 + 1) / 2 = -0.7; row 0 gets no gradient.
    """
    lp = logps()
    old = lp.detach().clone()
    old[0, 0] -= math.log(1.5)
    out = GRPOLoss(importance_sampling="sequence")(lp, MASK, ADV, REWARDS, 2, old_logps=old)
    torch.testing.assert_close(out.loss, torch.tensor(-0.7))
    out.loss.backward()
    assert torch.equal(lp.grad[0], torch.zeros(3))


def test_k3_kl_term():
    """ref - logp = log 2 on every token: k3 = 2 - log 2 - 1 = 0.306853. beta = 0.1, grpo aggregation.

    loss = -0.5 + 0.1 * 0.306853 = -0.469315; kl stat = 0.306853.
    """
    lp = logps()
    ref = lp.detach() + math.log(2)
    out = GRPOLoss(kl_coef=0.1)(lp, MASK, ADV, REWARDS, 2, ref_logps=ref)
    k3 = 1 - math.log(2)
    torch.testing.assert_close(out.loss, torch.tensor(-0.5 + 0.1 * k3))
    torch.testing.assert_close(out.stats["train/kl"], torch.tensor(k3))
    with pytest.raises(ValueError, match="ref_logps"):
        GRPOLoss(kl_coef=0.1)(logps(), MASK, ADV, REWARDS, 2)


def test_mask_truncated_completions():
    """Row 1 truncated and masked: grpo = ((-4)/2 + 0) / 2 = -1.0 (N still counts it); dapo = -4 / 2 = -2.0."""
    trunc = torch.tensor([False, True])
    for aggregation, expected in [("grpo", -1.0), ("dapo", -2.0)]:
        loss = GRPOLoss(aggregation=aggregation, mask_truncated_completions=True)
        out = loss(logps(), MASK, ADV, REWARDS, 2, truncated=trunc)
        torch.testing.assert_close(out.loss, torch.tensor(expected))
        context = loss.step_context(MASK.sum(-1), REWARDS, 2, truncated=trunc)
        assert context.num_tokens == 2 and context.num_sequences == 2


def test_amir_adds_lambda_times_pair_loss():
    """Rewards [1, 0] give one pair (0, 1). Mean logps l = [-1.5, -1.5] -> z = 0, pair loss = log 2.

    loss = grpo (-0.5) + 0.1 * log 2 = -0.430685; implicit and margin accuracy 0 (z is not > 0); margin 0.
    With reduction sum, l = [-3, -4.5], z = 0.2 * 1.5 = 0.3: pair loss = log(1 + e^-0.3) = 0.554355, implicit
    accuracy 1; the logged margin stays the length-normalised one (0).
    """
    loss = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.1, schedule="fixed"))
    out = loss(logps(), MASK, ADV, REWARDS, 2)
    torch.testing.assert_close(out.loss, torch.tensor(-0.5 + 0.1 * math.log(2)))
    assert out.stats["amir/num_pairs"] == 1 and out.stats["amir/implicit_acc"] == 0
    assert out.stats["amir/pair_acc"] == 0 and out.stats["amir/pair_margin"] == 0
    assert loss.step_context(MASK.sum(-1), REWARDS, 2).lambda_ == 0.1
    out = AmirGRPOLoss(
        pair_term=PairTermSettings(reduction="sum"), pair_weight=PairWeightSettings(value=0.1, schedule="fixed")
    )(logps(), MASK, ADV, REWARDS, 2)
    torch.testing.assert_close(out.stats["amir/pair_loss"], torch.tensor(math.log1p(math.exp(-0.3))))
    assert out.stats["amir/implicit_acc"] == 1 and out.stats["amir/pair_margin"] == 0


def test_amir_with_reference():
    """reference_free=False: ref mean logps [-1, -2] -> z = 0.2 * ((-1.5 + 1) - (-1.5 + 2)) = -0.2."""
    ref = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    loss = AmirGRPOLoss(
        pair_term=PairTermSettings(reference_free=False),
        pair_weight=PairWeightSettings(value=1.0, schedule="fixed", max=1.0),
    )
    out = loss(logps(), MASK, ADV, REWARDS, 2, ref_logps=ref)
    torch.testing.assert_close(out.stats["amir/pair_loss"], torch.tensor(math.log1p(math.exp(0.2))))
    assert loss.needs_reference and not AmirGRPOLoss().needs_reference
    with pytest.raises(ValueError, match="reference_free=False needs ref_logps"):
        loss(logps(), MASK, ADV, REWARDS, 2)


def test_amir_without_pairs_equals_grpo():
    rewards = torch.tensor([1.0, 1.0])
    a = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.05))(logps(), MASK, ADV, rewards, 2)
    g = GRPOLoss()(logps(), MASK, ADV, rewards, 2)
    torch.testing.assert_close(a.loss, g.loss)
    assert a.stats["amir/num_pairs"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"aggregation": "mean"},
        {"epsilon": 1.5},
        {"kl_coef": -1.0},
        {"importance_sampling": "tokens"},
        {"max_completion_length": 0},
    ],
)
def test_grpo_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GRPOLoss(**kwargs)


@pytest.mark.parametrize(
    ("settings", "kwargs", "message"),
    [
        (PairTermSettings, {"margin": -1.0}, "pair_term.margin must be >= 0"),
        (PairTermSettings, {"beta": 0.0}, "pair_term.beta must be > 0"),
        (PairTermSettings, {"mode": "topk"}, "pair_term.mode must be 'all' or 'top1'"),
        (PairWeightSettings, {"min": 0.1, "max": 0.01}, "pair_weight: need 0 < min <= max"),
        (PairWeightSettings, {"grow": 0.9}, "pair_weight: need grow > 1"),
    ],
)
def test_amir_rejects_bad_arguments(settings, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings(**kwargs)


@pytest.mark.parametrize("aggregation", ["bnpo", "dapo", "grpo"])
def test_a_process_without_tokens_does_not_scale_the_others_gradient(aggregation):
    """Two processes, the second with all of its groups dropped (``drop_zero_std_groups``): the first process's
    per-token weight, after data parallelism averages (x W / W), is what one process alone with that data gets.
    bnpo counted the empty process in its mean over processes, halving the gradient."""
    from amir_lightning.objectives.aggregation import global_normalizers, row_weights, summed_counts

    data = {"num_sequences": 8.0, "num_tokens": 40.0, "max_length": 9.0, "num_pairs": 5.0}
    empty = {"num_sequences": 0.0, "num_tokens": 0.0, "max_length": 1.0, "num_pairs": 0.0}

    def all_reduce(values, op):  # over the two processes
        if op == "max":
            return torch.tensor([max(data["max_length"], empty["max_length"])], dtype=torch.float64)
        return summed_counts(data) + summed_counts(empty)

    lengths = torch.tensor([5.0] * 8)
    alone = row_weights(aggregation, lengths, data)
    world = global_normalizers(data, 2, all_reduce, aggregation)
    scaled = row_weights(aggregation, lengths, world) * 2  # the module scales its loss by W = 2...
    torch.testing.assert_close(scaled / 2, alone)  # ...and data parallelism averages the gradients over W


def verl_dual_clip_token_losses(logps, old, adv, epsilon, c):
    """verl 0.9's vanilla policy loss per token (``compute_policy_loss_vanilla`` in ``verl/trainer/ppo/core_algos.py``),
    written here from its formula in float64: the clipped PPO loss, then for negative advantages at most ``-A c``."""
    ratio = (logps - old).exp()
    adv = adv[:, None]
    losses1 = -adv * ratio
    losses2 = -adv * ratio.clamp(1 - epsilon, 1 + epsilon)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -adv * c
    return torch.where(adv < 0, torch.minimum(losses3, clipped), clipped)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo"])
def test_dual_clip_bounds_a_negative_advantages_loss_as_verls_clip_ratio_c(aggregation):
    """Random off-policy ratios up to e^2, float64: the loss and its gradient equal verl's dual-clip loss aggregated
    as the aggregation says (``dapo``: the token mean, ``grpo``: the mean of each row's token mean), to 1e-12; a
    token with a negative advantage and a ratio above 3 gets no gradient; off (None), the loss is GRPO's own."""
    generator = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.5, -2.0, -0.5, 0.75], dtype=torch.float64)
    old = -torch.rand(4, 4, generator=generator, dtype=torch.float64) * 3
    shift = torch.rand(4, 4, generator=generator, dtype=torch.float64) * 4 - 2  # log-ratios in [-2, 2]
    shift[1, 0] = 1.5  # ratio 4.5 on a negative advantage: dual-clipped
    start = (old + shift).detach()
    ours = start.clone().requires_grad_(True)
    out = GRPOLoss(aggregation=aggregation, dual_clip=3.0)(ours, mask, adv, torch.zeros(4), 4, old_logps=old)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    token = verl_dual_clip_token_losses(theirs, old, adv, 0.2, 3.0) * mask
    expected = token.sum() / mask.sum() if aggregation == "dapo" else (token.sum(-1) / mask.sum(-1)).mean()
    expected.backward()
    assert abs(out.loss.item() - expected.item()) < 1e-12
    assert (ours.grad - theirs.grad).abs().max().item() < 1e-12
    assert ours.grad[1, 0] == 0 and out.stats["train/dual_clip_frac"] > 0
    plain = GRPOLoss(aggregation=aggregation)(start.clone(), mask, adv, torch.zeros(4), 4, old_logps=old)
    assert plain.loss.item() > out.loss.item() and "train/dual_clip_frac" not in plain.stats


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match=r"model.loss.init_args.dual_clip must be > 1"):
        GRPOLoss(dual_clip=1.0)


def trl_token_losses(kind, logps, old, adv, cap=5.0, tau_pos=1.0, tau_neg=1.05):
    """TRL 1.16's per-token losses (``GRPOTrainer._compute_loss`` in ``trl/trainer/grpo_trainer.py``), written here
    from its formulas in float64: ``cispo`` ``-sg(min(r, epsilon_high)) A logp``, ``sapo``
    ``-sigmoid(tau (r - 1)) 4 / tau A`` with ``tau`` by the advantage's sign."""
    ratio = (logps - old).exp()
    adv = adv[:, None]
    if kind == "cispo":
        return -ratio.clamp(max=cap).detach() * adv * logps
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


@pytest.mark.parametrize(("kind", "aggregation"), [("cispo", "dapo"), ("sapo", "grpo"), ("cispo", "grpo")])
def test_cispo_and_sapo_equal_trls_losses_and_gradients(kind, aggregation):
    """Random off-policy ratios up to e^2 (some above CISPO's cap of 5), float64: loss and gradient equal TRL's
    formula aggregated as the aggregation says (TRL aggregates cispo as ``dapo``, sapo as ``grpo``), to 1e-12. CISPO
    keeps a gradient on every token, the capped ones included; SAPO's gate is 1 at ratio 1, so on-policy it is
    GRPO's gradient."""
    generator = torch.Generator().manual_seed(9)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.5, -2.0, -0.5, 0.75], dtype=torch.float64)
    old = -torch.rand(4, 4, generator=generator, dtype=torch.float64) * 3
    start = (old + torch.rand(4, 4, generator=generator, dtype=torch.float64) * 4 - 2).detach()
    start[0, 0] = old[0, 0] + 1.9  # ratio 6.7 > 5 on a positive advantage: capped by CISPO
    ours = start.clone().requires_grad_(True)
    loss = GRPOLoss(aggregation=aggregation, policy_loss=kind)
    out = loss(ours, mask, adv, torch.zeros(4), 4, old_logps=old)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    token = trl_token_losses(kind, theirs, old, adv) * mask
    expected = token.sum() / mask.sum() if aggregation == "dapo" else (token.sum(-1) / mask.sum(-1)).mean()
    expected.backward()
    assert abs(out.loss.item() - expected.item()) < 1e-12
    assert (ours.grad - theirs.grad).abs().max().item() < 1e-12
    if kind == "cispo":
        assert ours.grad[0, 0] != 0 and out.stats["train/clip_frac"] > 0  # capped, still trained
    on_policy = start.clone().requires_grad_(True)
    loss(on_policy, mask, adv, torch.zeros(4), 4).loss.backward()
    grpo = start.clone().requires_grad_(True)
    GRPOLoss(aggregation=aggregation)(grpo, mask, adv, torch.zeros(4), 4).loss.backward()
    torch.testing.assert_close(on_policy.grad, grpo.grad, atol=1e-12, rtol=0)  # ratio 1: the same gradient


def test_cispo_and_sapo_go_with_the_pair_term_and_refuse_the_dual_clip():
    lp = logps()
    out = AmirGRPOLoss(policy_loss="sapo")(lp, MASK, ADV, REWARDS, 2)
    assert out.loss.isfinite() and "amir/pair_loss" in out.stats
    with pytest.raises(
        ValueError, match=r"dual_clip bounds the clipped surrogate: it needs policy_loss clip, not cispo"
    ):
        GRPOLoss(policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match=r"policy_loss must be clip, cispo or sapo, got 'vespo'"):
        GRPOLoss(policy_loss="vespo")


def trl_is_weights(old, sampling, mask, mode, cap, floor):
    """TRL 1.16's vLLM importance-sampling weights with ``vllm_importance_sampling_clip_min`` (its
    ``_generate_and_score_completions``), written here in float64."""
    diff = (old - sampling) * mask
    ratio = (diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff).exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=floor, max=cap) * mask
    return ratio.masked_fill((ratio < floor) | (ratio > cap), 0.0) * mask


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_a_lower_bound_on_the_importance_weights_is_trls_clip_min(mode):
    from amir_lightning.objectives.mismatch import mismatch_weights

    generator = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    old = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 3
    sampling = old + torch.randn(3, 4, generator=generator, dtype=torch.float64) * (0.05 if "sequence" in mode else 1)
    sampling[0, 0] = old[0, 0] + 2.0  # a token's weight e^-2, below the floor
    sampling[2, :2] = old[2, :2] + 0.5  # a completion's weight e^-1, below it too
    weights, stats = mismatch_weights(old, sampling, mask, mode, 3.0, float(mask.sum()), floor=0.5)
    expected = trl_is_weights(old, sampling, mask, mode, 3.0, 0.5)
    assert (weights - expected).abs().max().item() < 1e-12
    low = (0, 0) if mode.startswith("token") else (2, 0)
    assert weights[low].item() == (0.5 if mode.endswith("truncate") else 0.0)  # raised to the floor, or dropped


def test_the_off_policy_sequence_mask_drops_negative_advantages_the_engine_sampled_far_off_as_trl():
    """TRL 1.16's ``get_off_policy_mask`` (DeepSeek-V3.2): a completion with a negative advantage whose mean
    ``log q - log p`` exceeds the threshold leaves the term; a positive advantage never does. Loss and gradient equal
    the reference to 1e-12 (no importance weights, ``dapo``), and the dropped completion gets no gradient."""
    generator = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.5, -2.0, -0.5, 0.75], dtype=torch.float64)
    start = -torch.rand(4, 4, generator=generator, dtype=torch.float64) * 3
    sampling = start + 0.01 * torch.randn(4, 4, generator=generator, dtype=torch.float64)
    sampling[1] += 0.5  # far off, negative advantage: dropped
    sampling[0] += 0.5  # far off, positive advantage: kept
    ours = start.clone().requires_grad_(True)
    loss = GRPOLoss(aggregation="dapo", sampling_correction="none", off_policy_mask=0.1)
    out = loss(ours, mask, adv, torch.zeros(4), 4, sampling_logps=sampling)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    gap = ((sampling - theirs.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    keep = ((adv[:, None] >= 0) | (gap <= 0.1)).double()
    ratio = (theirs - theirs.detach()).exp()
    token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * keep * mask
    expected = token.sum() / mask.sum()
    expected.backward()
    assert keep[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert abs(out.loss.item() - expected.item()) < 1e-12 and (ours.grad - theirs.grad).abs().max().item() < 1e-12
    assert (ours.grad[1] == 0).all() and out.stats["train/off_policy_masked_frac"] == pytest.approx(4 / 13)


def verl_kl(logp, ref, estimator):
    """verl 0.9's ``kl_penalty`` (``verl/trainer/ppo/core_algos.py``), written here in float64: ``k1`` ``logp - ref``,
    ``k2`` half its square, ``k3`` (``low_var_kl``) ``exp(ref - logp) - (ref - logp) - 1`` (its clamps at 20 and 10 do
    not act here), and ``+``: the value with ``k2``'s gradient."""
    base = estimator.rstrip("+")
    if base == "k1":
        value = logp - ref
    elif base == "k2":
        value = 0.5 * (logp - ref).square()
    else:
        value = (ref - logp).exp() - (ref - logp) - 1
    if estimator.endswith("+"):
        k2 = 0.5 * (logp - ref).square()
        return k2 - k2.detach() + value.detach()
    return value


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k1+", "k3+"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "is_weighted"])
def test_every_kl_estimator_equals_verls_and_the_weighted_one_trls_bias_correction(estimator, weighted):
    """The KL term alone (zero advantages), off-policy, float64, ``dapo``: loss and gradient equal verl's estimate,
    times TRL's ratio (``use_bias_correction_kl``) when weighted, to 1e-12. ``k3+`` keeps ``k3``'s value and takes
    ``k2``'s gradient."""
    generator = torch.Generator().manual_seed(6)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    start = -torch.rand(3, 4, generator=generator, dtype=torch.float64) * 3
    ref = start + 0.5 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    old = start + 0.3 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    ours = start.clone().requires_grad_(True)
    loss = GRPOLoss(aggregation="dapo", kl_coef=0.5, kl_estimator=estimator, kl_importance_weighted=weighted)
    out = loss(ours, mask, zero, zero, 3, old_logps=old, ref_logps=ref)
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    per_token = verl_kl(theirs, ref, estimator) * ((theirs - old).exp() if weighted else 1.0)
    expected = 0.5 * (per_token * mask).sum() / mask.sum()
    expected.backward()
    assert abs(out.loss.item() - expected.item()) < 1e-12 and (ours.grad - theirs.grad).abs().max().item() < 1e-12
    if estimator == "k3+":
        plain = start.clone().requires_grad_(True)
        k3 = GRPOLoss(aggregation="dapo", kl_coef=0.5, kl_importance_weighted=weighted)
        assert abs(k3(plain, mask, zero, zero, 3, old_logps=old, ref_logps=ref).loss.item() - out.loss.item()) < 1e-12


def test_an_unknown_kl_estimator_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"model.loss.init_args.kl_estimator must be one of k1, k2, k3, k1\+, k3\+"):
        GRPOLoss(kl_estimator="k4")
