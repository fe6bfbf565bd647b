"""The adaptive lambda controller: a band on the pair term's gradient share, tested on a real run's statistics."""

import json
import random
from pathlib import Path

import pytest
import torch

from amir_lightning.objectives import AmirGRPOLoss
from amir_lightning.objectives.amir import PairWeightSettings


def step(loss, pair_grad, pg_scale, num_pairs=3.0, pg_loss=0.0):
    f64 = torch.float64
    loss.end_step(
        {
            "amir/pair_grad": torch.tensor(pair_grad, dtype=f64),
            "train/pg_scale": torch.tensor(pg_scale, dtype=f64),
            "amir/num_pairs": torch.tensor(num_pairs),
            "train/pg_loss": torch.tensor(pg_loss),
        }
    )
    return float(loss.schedule.lambda_value)


def test_band_rule_hand_computed():
    """lambda 0.01, pair gradient mass 0.19, M 0.5: share 0.0038 < 0.005 -> x1.25 = 0.0125 (EMA starts at M).

    Then M 0.3: EMA = 0.9 * 0.5 + 0.1 * 0.3 = 0.48, share 0.0125 * 0.19 / 0.48 = 0.00495 -> x1.25 = 0.015625;
    then M 0.05: EMA 0.437, share 0.0068 is inside the band 0.005-0.015: lambda stays.
    """
    loss = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01))
    assert abs(step(loss, 0.19, 0.5) - 0.0125) < 1e-12
    assert abs(float(loss.schedule.pg_scale_ema) - 0.5) < 1e-12
    assert abs(step(loss, 0.19, 0.3) - 0.015625) < 1e-12
    assert abs(step(loss, 0.19, 0.05) - 0.015625) < 1e-12


def test_shrinks_above_band_and_clamps():
    loss = AmirGRPOLoss(
        pair_weight=PairWeightSettings(value=0.2, scale_ema=0.0)
    )  # initial lambda above lambda_max is pulled in
    assert step(loss, 1.0, 0.001) == 0.05
    assert abs(step(loss, 1.0, 0.001) - 0.04) < 1e-12  # ratio 0.05 / 0.001 = 50 > 0.7 -> x0.8
    for _ in range(50):
        lam = step(loss, 1.0, 0.001)
    assert lam == 0.005


def test_no_pairs_or_fixed_schedule_keep_lambda():
    loss = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01))
    assert step(loss, 0.0, 0.05, num_pairs=0.0) == 0.01
    fixed = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01, schedule="fixed"))
    assert step(fixed, 0.19, 0.5) == 0.01


def official_update(lam, pair_loss, signed_grpo_loss):
    """The official controller as its code runs it (signed GRPO loss, clamped at 1e-9)."""
    r = lam * pair_loss / max(1e-9, signed_grpo_loss)
    if r < 0.3:
        return min(0.05, 1.25 * lam)
    if r > 0.7:
        return max(0.005, 0.8 * lam)
    return lam


def test_settles_where_the_official_rule_random_walks():
    """Same stream of steps: signed GRPO loss ~ N(0, 0.01) (on-policy noise), magnitude M ~ 0.5 +- 5 %.

    Ours converges into the band and then holds lambda fixed; the official rule keeps moving between its bounds.
    """
    rng = random.Random(0)
    ours, official = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01)), 0.01
    ours_trace, official_trace = [], []
    for _ in range(200):
        signed = rng.gauss(0.0, 0.01)
        scale = 0.5 * (1 + rng.uniform(-0.05, 0.05))
        ours_trace.append(step(ours, 0.19, scale, pg_loss=signed))
        official = official_update(official, 0.69, signed)
        official_trace.append(official)
    tail = ours_trace[50:]
    assert max(tail) == min(tail)  # settled
    assert 0.005 <= tail[-1] * 0.19 / 0.5 <= 0.015 * 1.06
    changes = sum(a != b for a, b in zip(official_trace[50:], official_trace[51:]))
    assert changes > 50  # the official controller keeps jumping


def test_state_round_trips_through_state_dict():
    loss = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01))
    step(loss, 0.19, 0.5)
    restored = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.01))
    restored.load_state_dict(loss.state_dict())
    assert float(restored.schedule.lambda_value) == float(loss.schedule.lambda_value) == 0.0125
    assert float(restored.schedule.pg_scale_ema) == 0.5


def test_on_a_real_runs_statistics_lambda_moves_inside_its_bounds():
    """The per-step statistics of `make demo` (tests/fixtures/demo_lambda_stats.json): the pair gradient mass stays
    at 0.18-0.19 while the policy-gradient magnitude falls from 0.8 to 0.08 as groups lose reward variance.

    The previous controller (lambda * L_pref against M, band 0.3-0.7) pinned lambda at lambda_max on every step; this
    one leaves the bounds from either start (the demo's 0.05, qwen.yaml's 0.01) and lowers lambda as M falls.
    """
    steps = json.loads((Path(__file__).parent / "fixtures" / "demo_lambda_stats.json").read_text())["steps"]
    previous, ema = 0.05, None
    for s in steps:  # the previous rule, for the record
        ema = s["pg_scale"] if ema is None else 0.9 * ema + 0.1 * s["pg_scale"]
        share = previous * s["pair_loss"] / ema
        previous = min(0.05, max(0.005, previous * (1.25 if share < 0.3 else 0.8 if share > 0.7 else 1.0)))
        assert previous == 0.05
    for start in (0.05, 0.01):
        loss = AmirGRPOLoss(pair_weight=PairWeightSettings(value=start))
        trace = [step(loss, s["pair_grad"], s["pg_scale"], s["num_pairs"]) for s in steps]
        assert all(0.005 <= lam <= 0.05 for lam in trace)
        assert sum(0.005 < lam < 0.05 for lam in trace) == len(trace)  # never pinned at a bound
        assert len(set(trace)) >= 2 and trace[-1] != start  # it moves
    assert max(trace) >= start * 1.25**3 - 1e-12  # from 0.01 it rises three steps toward the band


def test_on_resume_a_fixed_lambda_is_this_runs_and_an_adaptive_one_continues():
    """A fixed lambda is configuration: the value given to the resumed run wins over the checkpoint's. An adaptive
    lambda is the controller's state: it continues from the checkpoint (lambda_ was only its starting value)."""
    fixed = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.3, schedule="fixed", max=1.0))
    resumed = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.1, schedule="fixed", max=1.0))
    resumed.load_state_dict(fixed.state_dict())
    assert resumed.lambda_now == 0.1
    adaptive = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.02))
    adaptive.end_step({"amir/num_pairs": torch.tensor(3.0), "amir/pair_grad": torch.tensor(0.2),
                       "train/pg_scale": torch.tensor(1.0)})  # fmt: skip
    moved = adaptive.lambda_now
    assert moved != 0.02
    again = AmirGRPOLoss(pair_weight=PairWeightSettings(value=0.02))
    again.load_state_dict(adaptive.state_dict())
    assert again.lambda_now == moved


def test_the_lr_schedule_follows_the_runs_length_and_a_resumed_run_stretches_it():
    """``WarmupCosineLR`` without ``total_steps`` takes the run's: ``max_steps``, else ``max_epochs`` x a rollout's
    steps x passes. A resumed run that was given more epochs keeps its position on the longer schedule."""
    from types import SimpleNamespace

    from amir_lightning.loop.collect import RolloutSettings
    from amir_lightning.systems.schedules import WarmupCosineLR
    from amir_lightning.systems.summary import planned_steps

    settings = RolloutSettings(prompts_per_process=4, steps_per_rollout=2, passes=3)
    trainer = SimpleNamespace(max_steps=-1, max_epochs=50, datamodule=SimpleNamespace(settings=settings))
    assert planned_steps(trainer) == 300
    trainer.max_steps = 40
    assert planned_steps(trainer) == 40

    def schedule(total):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = WarmupCosineLR(optimizer, warmup_ratio=0.1)
        scheduler.set_total_steps(total)
        return optimizer, scheduler

    optimizer, scheduler = schedule(100)
    for _ in range(60):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.factor(60))
    longer, resumed = schedule(200)
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.total_steps == 200 and resumed.last_epoch == 60
    assert longer.param_groups[0]["lr"] == pytest.approx(resumed.factor(60))
    assert resumed.factor(60) > scheduler.factor(60)  # earlier on the longer cosine


def test_the_rewards_trainer_state_counts_the_steps_the_lr_schedule_spans():
    """``trainer_state.max_steps`` reaches the rewards through ``At``: ``max_epochs`` x steps x passes, as the LR
    schedule's. It left out the passes: 20 where 40 steps were planned (10 rollouts x 2 steps x 2 passes)."""
    from types import SimpleNamespace

    from amir_lightning.data import ArithmeticPrompts
    from amir_lightning.engines import HFEngine
    from amir_lightning.loop.collect import RolloutSettings
    from amir_lightning.systems.datamodule import RolloutDataModule
    from amir_lightning.systems.summary import planned_steps

    settings = RolloutSettings(prompts_per_process=4, steps_per_rollout=2, passes=2)
    data = RolloutDataModule(prompts=ArithmeticPrompts(), engine=HFEngine(progress=False), rollout=settings)
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    data.trainer = SimpleNamespace(max_steps=-1, max_epochs=10, datamodule=data, global_step=3, global_rank=0,
                                   world_size=1, current_epoch=1, strategy=strategy)  # fmt: skip
    assert data.at().max_steps == planned_steps(data.trainer) == 40
    data.trainer.max_epochs = -1
    assert data.at().max_steps == -1  # no set length
