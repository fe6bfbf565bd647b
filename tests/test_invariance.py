"""Normalisation invariance: a step's gradient is the same whole or split into micro-batches of whole groups.

Also a parity check against an independent float64 reference written from the definitions, token by token.
"""

import itertools
import math

import pytest
import torch

from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages
from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings

G, B, T = 4, 8, 9
AGGREGATIONS = ["grpo", "bnpo", "dr_grpo", "dapo"]


def make_step(seed=0):
    """A step of B groups of G completions with ragged lengths, ties in rewards, off-policy ratios and a reference."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B * G,), generator=gen)
    lengths[3] = T  # at least one full-length completion
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 3, (B * G,), generator=gen).double() * 0.5
    rewards[:G] = 1.0  # an all-equal group
    logps = -torch.rand(B * G, T, generator=gen, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B * G, T, generator=gen, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(B * G, T, generator=gen, dtype=torch.float64)
    # the engine's log-probs: close to the sampling policy's, a few far enough for the mismatch weights to hit the cap
    sampling = old + 0.1 * torch.randn(B * G, T, generator=gen, dtype=torch.float64)
    sampling[5, :3] -= 2.0
    truncated = lengths == T
    return dict(logps=logps, mask=mask, rewards=rewards, old=old, ref=ref, sampling=sampling, truncated=truncated)


def make_losses(aggregation):
    common = dict(aggregation=aggregation, kl_coef=0.05, epsilon_high=0.28, mask_truncated_completions=True)
    return {
        "grpo": GRPOLoss(**common),
        "grpo_seq": GRPOLoss(**common | {"importance_sampling": "sequence"}),
        "grpo_seq_mask": GRPOLoss(**common | {"sampling_correction": "sequence_mask", "sampling_cap": 1.2}),
        "dual_clip": GRPOLoss(**common | {"dual_clip": 1.5}),
        "floor_opsm": GRPOLoss(**common | {"sampling_floor": 0.9, "off_policy_mask": 0.02}),
        "kl_k3plus_weighted": GRPOLoss(**common | {"kl_estimator": "k3+", "kl_importance_weighted": True}),
        "kl_k1": GRPOLoss(**common | {"kl_estimator": "k1"}),
        "cispo": GRPOLoss(**common | {"policy_loss": "cispo", "cispo_max": 1.2}),
        "sapo_seq": GRPOLoss(**common | {"policy_loss": "sapo", "importance_sampling": "sequence"}),
        "amir_cispo": AmirGRPOLoss(**common, policy_loss="cispo", pair_weight=PairWeightSettings(value=0.5, max=1.0)),
        "amir": AmirGRPOLoss(**common, pair_weight=PairWeightSettings(value=0.5, max=1.0, schedule="fixed")),
        "amir_ref_top1": AmirGRPOLoss(
            **common,
            pair_term=PairTermSettings(
                reference_free=False, mode="top1", reduction="sum", max_per_group=2, margin=0.25
            ),
            pair_weight=PairWeightSettings(value=0.5, max=1.0),
        ),
    }


def run(loss, step, micro_batches):
    """Gradient of the step split into ``micro_batches`` chunks of whole groups, each trimmed to its own width."""
    logps = step["logps"].clone().requires_grad_(True)
    adv = group_advantages(step["rewards"], G)
    context = loss.step_context(step["mask"].sum(-1), step["rewards"], G, truncated=step["truncated"])
    total, stats = 0.0, {}
    per = B * G // micro_batches
    for start in range(0, B * G, per):
        rows = slice(start, start + per)
        width = int(step["mask"][rows].sum(-1).max())  # each micro-batch padded to its own longest completion
        cols = slice(0, width)
        out = loss(
            logps[rows, cols],
            step["mask"][rows, cols],
            adv[rows],
            step["rewards"][rows],
            G,
            old_logps=step["old"][rows, cols],
            ref_logps=step["ref"][rows, cols],
            truncated=step["truncated"][rows],
            sampling_logps=step["sampling"][rows, cols],
            context=context,
        )
        out.loss.backward()
        total += out.loss.detach()
        for key, value in out.stats.items():
            stats[key] = stats.get(key, 0.0) + value
    return total, logps.grad, stats


@pytest.mark.parametrize(("aggregation", "name"), list(itertools.product(AGGREGATIONS, make_losses("grpo"))))
def test_micro_batches_give_the_full_batch_gradient(aggregation, name):
    step = make_step()
    loss = make_losses(aggregation)[name]
    full_loss, full_grad, full_stats = run(loss, step, 1)
    assert full_grad.abs().sum() > 0
    for micro_batches in (2, 4):
        part_loss, part_grad, part_stats = run(loss, step, micro_batches)
        torch.testing.assert_close(part_grad, full_grad, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(part_loss, full_loss, rtol=1e-6, atol=1e-12)
        keys = (
            "train/pg_loss",
            "train/clip_frac",
            "amir/num_pairs",
            "amir/pair_loss",
            "amir/pair_acc",
            "amir/implicit_acc",
            "amir/pair_margin",
            "amir/pair_grad",
            "rollout/engine_trainer_kl",
            "train/is_weight_mean",
        )
        assert set(keys) - {"amir/pair_loss", "amir/implicit_acc", "amir/pair_grad"} <= set(full_stats)
        for key in keys:
            if key in full_stats:
                torch.testing.assert_close(
                    torch.as_tensor(part_stats[key]).double(),
                    torch.as_tensor(full_stats[key]).double(),
                    rtol=1e-6,
                    atol=1e-12,
                )


def reference_loss(step, aggregation, sequence_is, beta, eps_low, eps_high, lam, pair_beta, max_length, correction):
    """Independent float64 implementation from the equations, with Python loops over sequences and tokens.

    ``correction`` is ``(mode, cap)`` of the engine/trainer mismatch weights p_old / q, each token's loss times it.
    """
    logps, mask, rewards, old, ref = step["logps"], step["mask"], step["rewards"], step["old"], step["ref"]
    n = len(rewards)
    adv = []
    for g in range(0, n, G):
        r = [float(x) for x in rewards[g : g + G]]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        adv += [0.0 if max(r) == min(r) else (x - mean) / (std + 1e-4) for x in r]
    seq_terms, token_total, token_count = [], 0.0, 0
    for i in range(n):
        length = int(mask[i].sum())
        if sequence_is:
            s = sum(logps[i, t] - old[i, t] for t in range(length)) / length
            ratios = [torch.exp(s)] * length
        else:
            ratios = [torch.exp(logps[i, t] - old[i, t]) for t in range(length)]
        mode, cap = correction
        token_w = [math.exp(float(old[i, t] - step["sampling"][i, t])) for t in range(length)]
        if mode.startswith("sequence"):
            token_w = [math.prod(token_w)] * length
        token_w = [min(w, cap) if mode.endswith("truncate") else (0.0 if w > cap else w) for w in token_w]
        terms = []
        for t in range(length):
            clipped = ratios[t].clamp(1 - eps_low, 1 + eps_high)
            c = -torch.minimum(ratios[t] * adv[i], clipped * adv[i])
            d = ref[i, t] - logps[i, t]
            terms.append(token_w[t] * c + beta * (torch.exp(d) - d - 1))  # the KL term is not reweighted
        seq_terms.append(sum(terms) / length)
        token_total = token_total + sum(terms)
        token_count += length
    if aggregation == "grpo":
        pg = sum(seq_terms) / n
    elif aggregation == "dr_grpo":
        pg = token_total / (n * max_length)
    else:
        pg = token_total / token_count
    pair_sum, pairs = 0.0, 0
    for g in range(0, n, G):
        for i in range(g, g + G):
            for j in range(g, g + G):
                if rewards[i] - rewards[j] > 0:
                    li = sum(logps[i, t] for t in range(int(mask[i].sum()))) / int(mask[i].sum())
                    lj = sum(logps[j, t] for t in range(int(mask[j].sum()))) / int(mask[j].sum())
                    pair_sum = pair_sum - torch.log(torch.sigmoid(pair_beta * (li - lj)))
                    pairs += 1
    return pg + lam * pair_sum / max(pairs, 1)


CORRECTIONS = [("token_truncate", 3.0), ("sequence_mask", 1.2)]


@pytest.mark.parametrize(
    ("aggregation", "sequence_is", "correction"), list(itertools.product(AGGREGATIONS, [False, True], CORRECTIONS))
)
def test_parity_with_float64_reference(aggregation, sequence_is, correction):
    step = make_step(seed=1)
    step["logps"] = step["logps"].requires_grad_(True)
    kwargs = dict(
        aggregation=aggregation,
        kl_coef=0.05,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=12,
        importance_sampling="sequence" if sequence_is else "token",
        sampling_correction=correction[0],
        sampling_cap=correction[1],
    )
    loss = AmirGRPOLoss(
        **kwargs,
        pair_term=PairTermSettings(beta=0.7),
        pair_weight=PairWeightSettings(value=0.3, max=1.0, schedule="fixed"),
    )
    adv = group_advantages(step["rewards"], G)
    out = loss(
        step["logps"],
        step["mask"],
        adv,
        step["rewards"],
        G,
        old_logps=step["old"],
        ref_logps=step["ref"],
        sampling_logps=step["sampling"],
    )
    ours = out.loss
    (ours_grad,) = torch.autograd.grad(ours, step["logps"])
    expected = reference_loss(step, aggregation, sequence_is, 0.05, 0.2, 0.28, 0.3, 0.7, 12, correction)
    (expected_grad,) = torch.autograd.grad(expected, step["logps"])
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_mismatch_stats_match_their_definitions():
    """engine_kl = mean over tokens of (w - 1) - log w with w = p_old / q; with the cap at 3, the two tokens whose
    engine log-prob sits 2 nats below the trainer's (w = e^2 ~ 7.4) are the capped ones."""
    step = make_step(seed=2)
    old, sampling, mask = step["old"], step["sampling"].clone(), step["mask"].double()
    sampling[:, :] = old  # an exact engine...
    sampling[7, :2] = old[7, :2] - 2.0  # ...except two tokens
    adv = group_advantages(step["rewards"], G)
    loss = GRPOLoss(sampling_cap=3.0)
    stats = loss(step["logps"], step["mask"], adv, step["rewards"], G, old_logps=old, sampling_logps=sampling)
    log_w = (old - sampling) * mask
    tokens = mask.sum()
    torch.testing.assert_close(
        stats.stats["rollout/engine_trainer_kl"], ((log_w.exp() - 1 - log_w) * mask).sum() / tokens
    )
    assert float(stats.stats["train/is_capped_frac"]) == pytest.approx(2 / float(tokens))
    assert float(stats.stats["train/is_weight_mean"]) == pytest.approx((float(tokens) - 2 + 2 * 3.0) / float(tokens))
    off = GRPOLoss(sampling_correction="none")
    plain = off(step["logps"], step["mask"], adv, step["rewards"], G, old_logps=old, sampling_logps=sampling)
    assert "train/is_weight_mean" not in plain.stats and torch.equal(
        plain.stats["rollout/engine_trainer_kl"], stats.stats["rollout/engine_trainer_kl"]
    )
