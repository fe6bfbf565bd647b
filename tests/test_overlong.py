"""DAPO's soft overlong punishment (``OverlongPenalty``): 0, then linear to -1 over the buffer before the cap."""

import pytest
from test_datamodule import build, make_trainer

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion, Episode
from amir_lightning.loop.rewarding import score_completions
from amir_lightning.rewards import OverlongPenalty
from amir_lightning.rewards.base import call_reward
from amir_lightning.rewards.inputs import RewardInputs


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


def episode(turns: list[int], reply: int, finish_reason: str = "stop") -> Completion:
    """A multi-turn episode whose policy turns have ``turns`` tokens, a tool reply of ``reply`` tokens (masked out of
    the loss, as ``run_episodes`` writes it) between each two."""
    ids, mask = [], []
    for number, length in enumerate(turns):
        if number:
            ids, mask = ids + [7] * reply, mask + [0] * reply
        ids, mask = ids + [5] * length, mask + [1] * length
    episode = Episode(mask, tool_calls=len(turns) - 1, turns=len(turns))
    return Completion(ids, "x", [0.0] * len(ids), finish_reason, episode=episode)


def test_an_episode_is_penalised_by_its_longest_policy_turn_against_the_turn_cap():
    """The cap applies to each policy turn (``max_new_tokens``): a tool's replies and the other turns do not count.
    Before, the penalty counted every token: the untruncated 2-turn episode of 40 policy tokens (20 + 20, a reply of
    30 between them, 70 tokens in all) scored -1.0 against a cap of 64; by its longest turn (20) it is 0.0. A turn
    of 60 tokens is inside the buffer: (48 - 60) / 16 = -0.75."""
    reward = OverlongPenalty(buffer_tokens=16)
    reward.fit_to_sampling(64)
    completions = [[episode([20, 20], reply=30), episode([10, 60], reply=30, finish_reason="length")]]
    total, metrics, _, _ = score_completions([reward], [Prompt("q", "")], completions)
    assert total.tolist() == [0.0, -0.75]
    single = [[Completion([1] * 60, "a", [0.0] * 60, "stop")]]  # no mask: every token is the policy's
    assert score_completions([reward], [Prompt("q", "")], single)[0].tolist() == [-0.75]


def test_a_cap_above_the_runs_max_new_tokens_is_refused_naming_the_key():
    """No turn runs past ``data.sampling.max_new_tokens``: a ``max_tokens`` above it never reaches -1 at the cut, and
    from 64 + buffer up never applies at all. Before, it was accepted."""
    reward = OverlongPenalty(buffer_tokens=16, max_tokens=128)
    with pytest.raises(ValueError) as info:
        reward.fit_to_sampling(64)
    assert str(info.value) == (
        "data.rewards: OverlongPenalty.max_tokens (128) is above data.sampling.max_new_tokens (64), the most tokens "
        "a turn can have: the penalty would never reach -1 (give at most 64, or leave it unset)"
    )
    OverlongPenalty(buffer_tokens=16, max_tokens=64).fit_to_sampling(64)  # the cap itself is fine


def test_amir_fit_refuses_a_cap_above_max_new_tokens_in_one_line(tmp_path, monkeypatch, capsys):
    """Through ``amir fit`` (tiny.yaml, ``max_new_tokens`` 2): exit 2, one line naming the key, before any rollout."""
    from test_faults import fit_here

    penalty = "{class_path: OverlongPenalty, init_args: {buffer_tokens: 1, max_tokens: 8}}"
    code, err = fit_here(tmp_path, monkeypatch, capsys, ["--data.rewards", f"[{penalty}]"])
    lines = [line for line in err.splitlines() if line.startswith("amir: error:")]
    assert code == 2 and lines == [
        "amir: error: data.rewards: OverlongPenalty.max_tokens (8) is above data.sampling.max_new_tokens (2), the "
        "most tokens a turn can have: the penalty would never reach -1 (give at most 2, or leave it unset)"
    ], err[-2000:]
