"""The adaptive lambda controller: official band rule, made robust to the ~0 signed GRPO loss."""

import random

import torch

from amir_lightning.objectives import AmirGRPOLoss


def step(loss, pair_loss, pg_scale, num_pairs=3.0, pg_loss=0.0):
    f64 = torch.float64
    loss.end_step(
        {
            "pair_loss": torch.tensor(pair_loss, dtype=f64),
            "pg_scale": torch.tensor(pg_scale, dtype=f64),
            "num_pairs": torch.tensor(num_pairs),
            "pg_loss": torch.tensor(pg_loss),
        }
    )
    return float(loss.lambda_value)


def test_band_rule_hand_computed():
    """lambda 0.01, pair loss 0.69, M 0.05: ratio 0.138 < 0.3 -> x1.25 = 0.0125 (EMA starts at the first M).

    Then M 0.01: EMA = 0.9 * 0.05 + 0.1 * 0.01 = 0.046, ratio 0.0125 * 0.69 / 0.046 = 0.1875 -> x1.25 = 0.015625.
    """
    loss = AmirGRPOLoss(lambda_=0.01)
    assert abs(step(loss, 0.69, 0.05) - 0.0125) < 1e-12
    assert abs(float(loss.pg_scale_ema) - 0.05) < 1e-12
    assert abs(step(loss, 0.69, 0.01) - 0.015625) < 1e-12


def test_shrinks_above_band_and_clamps():
    loss = AmirGRPOLoss(lambda_=0.2, scale_ema=0.0)  # initial lambda above lambda_max is pulled in
    assert step(loss, 1.0, 0.001) == 0.05
    assert abs(step(loss, 1.0, 0.001) - 0.04) < 1e-12  # ratio 0.05 / 0.001 = 50 > 0.7 -> x0.8
    for _ in range(50):
        lam = step(loss, 1.0, 0.001)
    assert lam == 0.005


def test_no_pairs_or_fixed_schedule_keep_lambda():
    loss = AmirGRPOLoss(lambda_=0.01)
    assert step(loss, 0.0, 0.05, num_pairs=0.0) == 0.01
    fixed = AmirGRPOLoss(lambda_=0.01, lambda_schedule="fixed")
    assert step(fixed, 0.69, 0.05) == 0.01


def official_update(lam, pair_loss, signed_grpo_loss):
    """The official controller as its code runs it (signed GRPO loss, clamped at 1e-9)."""
    r = lam * pair_loss / max(1e-9, signed_grpo_loss)
    if r < 0.3:
        return min(0.05, 1.25 * lam)
    if r > 0.7:
        return max(0.005, 0.8 * lam)
    return lam


def test_settles_where_the_official_rule_random_walks():
    """Same stream of steps: signed GRPO loss ~ N(0, 0.01) (on-policy noise), magnitude M ~ 0.05 +- 5 %.

    Ours converges into the band and then holds lambda fixed; the official rule keeps moving between its bounds.
    """
    rng = random.Random(0)
    ours, official = AmirGRPOLoss(lambda_=0.01), 0.01
    ours_trace, official_trace = [], []
    for _ in range(200):
        signed = rng.gauss(0.0, 0.01)
        scale = 0.05 * (1 + rng.uniform(-0.05, 0.05))
        ours_trace.append(step(ours, 0.69, scale, pg_loss=signed))
        official = official_update(official, 0.69, signed)
        official_trace.append(official)
    tail = ours_trace[50:]
    assert max(tail) == min(tail)  # settled
    assert 0.3 <= tail[-1] * 0.69 / 0.05 <= 0.7 * 1.06
    changes = sum(a != b for a, b in zip(official_trace[50:], official_trace[51:]))
    assert changes > 50  # the official controller keeps jumping


def test_state_round_trips_through_state_dict():
    loss = AmirGRPOLoss(lambda_=0.01)
    step(loss, 0.69, 0.05)
    restored = AmirGRPOLoss(lambda_=0.01)
    restored.load_state_dict(loss.state_dict())
    assert float(restored.lambda_value) == float(loss.lambda_value) == 0.0125
    assert float(restored.pg_scale_ema) == 0.05
