"""DAPO's soft overlong punishment (``OverlongPenalty``): 0, then linear to -1 over the buffer before the cap."""

import pytest
from test_datamodule import build, make_trainer

from amir_lightning.data.base import Prompt
from amir_lightning.rewards import OverlongPenalty
from amir_lightning.rewards.base import call_reward
from amir_lightning.rewards.inputs import RewardInputs
from amir_lightning.rollout.engine import Completion
from amir_lightning.rollout.rewarding import score_completions


@pytest.mark.parametrize(("length", "penalty"), [(3, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (12, -1.0)])
def test_the_penalty_is_zero_before_the_buffer_and_falls_linearly_to_minus_one_at_the_cap(length, penalty):
    reward = OverlongPenalty(buffer_tokens=4, max_tokens=10)
    assert reward.penalty(length) == penalty
    assert call_reward(reward, RewardInputs(["x"], [Prompt("q", "")], [[5] * length], ["stop"])) == [penalty]


def test_the_cap_is_the_runs_max_new_tokens_unless_given():
    unset, given = OverlongPenalty(buffer_tokens=4), OverlongPenalty(buffer_tokens=4, max_tokens=8)
    for reward in (unset, given):
        reward.fit_to_sampling(32)
    assert (unset.max_tokens, given.max_tokens) == (32, 8)
    with pytest.raises(ValueError, match=r"buffer_tokens \(64\) must be below the length cap \(data.sampling.max_new"):
        OverlongPenalty().fit_to_sampling(64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_tokens": 0}, "OverlongPenalty.buffer_tokens"),
        ({"buffer_tokens": 8, "max_tokens": 8}, r"buffer_tokens \(8\) must be below the length cap \(data.rewards"),
        ({"max_tokens": 1}, "OverlongPenalty.max_tokens"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OverlongPenalty(**kwargs)


def test_a_run_sets_the_cap_from_its_sampling_and_logs_the_penalty(tmp_path):
    """The run's ``max_new_tokens`` (4) becomes the cap; the penalty is logged and adds to the other reward."""
    module, data = build(tmp_path)
    penalty = OverlongPenalty(buffer_tokens=2)
    data.rewards = [*data.rewards, penalty]
    trainer = make_trainer(tmp_path, 1, [])
    trainer.fit(module, datamodule=data)
    data.engine.close()
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert penalty.max_tokens == 4 and -1.0 <= logged["rollout/reward/overlong"] < 0.0  # the tiny policy runs long
    total = logged["rollout/reward/length"] + logged["rollout/reward/overlong"]
    assert logged["rollout/reward_mean"] == pytest.approx(total, rel=1e-6)


def test_the_penalty_adds_to_the_total_with_its_weight():
    reward = OverlongPenalty(buffer_tokens=2, max_tokens=4, weight=0.5)
    completions = [[Completion([1, 2], "a", [0.0] * 2, "stop"), Completion([1, 2, 3, 4], "b", [0.0] * 4, "length")]]
    total, metrics, _, _ = score_completions([reward], [Prompt("q", "")], completions)
    assert total.tolist() == [0.0, -0.5] and metrics["rollout/reward/overlong"] == -0.5
