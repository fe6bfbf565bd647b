"""TRL's reward-function signature, complete: ``trainer_state``, ``log_metric`` and ``log_extra`` reach rewards,
are logged under ``reward/`` and in the sample table, and survive sampling ahead, dynamic sampling and checkpoints."""

import io
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import HF_ENGINE, read_scalars, run_here
from helpers import ranks
from helpers.refill import refill

from amir_lightning.callbacks import RolloutSampleLogger
from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.helpers.serving import free_port
from amir_lightning.loop.batch import make_groups
from amir_lightning.loop.dynamic import Round
from amir_lightning.loop.pending import PendingRollout, SavedRollout
from amir_lightning.loop.rewarding import Scores, score_completions
from amir_lightning.rewards import FunctionReward, RunState
from amir_lightning.rewards.base import RewardError

ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def _helpers_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "helpers"))


def rollout(texts=("3", "35", "4", "x")):
    """One prompt "3=" (reference 3, dataset column ``solution``) and its completions ``texts``."""
    prompt = Prompt("3=", "3", {}, None, {"prompt": "3=", "solution": "3"})
    return [prompt], [[Completion([ord(t[0])], t, [0.0], "stop") for t in texts]]


def test_a_function_gets_the_run_state_and_its_metrics_and_columns_are_kept():
    prompts, completions = rollout()
    state = RunState(global_step=6, epoch=0.5, rollout=3, max_steps=12)
    rewards = [FunctionReward("trl_rewards.first_digit"), FunctionReward("trl_rewards.warmup")]
    total, metrics, _, extra = score_completions(rewards, prompts, completions, state=state)
    assert metrics["reward/step_seen"] == 6.0 and metrics["reward/rollout_seen"] == 3.0
    assert metrics["reward/hit_rate"] == 0.5  # "3" and "35" start with 3
    assert extra == {"parsed": ["3", "3", "4", "x"]}
    # warmup scales by progress 6 / 12: length 2 ("35") scores 1.0 on top of its hit
    assert total.tolist() == [1.5, 2.0, 0.5, 0.5]


def test_trls_own_accuracy_reward_signature_logs_its_columns():
    prompts, completions = rollout()
    _, _, _, extra = score_completions([FunctionReward("trl_rewards.accuracy_like_trl")], prompts, completions)
    assert extra == {"solution": ["3"] * 4, "answer_parsed": ["3", "35", "4", "x"]}


def test_a_metric_logged_twice_in_a_rollout_is_averaged():
    prompts, completions = rollout()
    rewards = [FunctionReward("trl_rewards.first_digit", name="a"), FunctionReward("trl_rewards.first_digit", name="b")]
    state = RunState(global_step=2)
    _, metrics, _, _ = score_completions(rewards, prompts, completions, state=state)
    assert metrics["reward/step_seen"] == 2.0 and metrics["reward/hit_rate"] == 0.5


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("wrong_length_column", "log_extra('verdict', ...) got 1 values; it takes one value per completion (4)"),
        ("text_metric", "log_metric('mood', 'fine') needs a number"),
    ],
)
def test_logging_misused_is_an_error_naming_the_reward(function, says):
    prompts, completions = rollout()
    with pytest.raises(RewardError, match="reward " + function) as info:
        score_completions([FunctionReward(f"trl_rewards.{function}")], prompts, completions)
    assert says in str(info.value)


def test_a_rollout_sampled_ahead_is_scored_with_the_state_it_was_drawn_in_and_a_checkpoint_keeps_both(tmp_path):
    """Scored later (when an epoch takes it, or at a checkpoint), it still sees the step whose weights sampled it;
    its columns and state go through a ``weights_only`` checkpoint load."""
    prompts, completions = rollout()
    drawn = RunState(global_step=4, epoch=1.25, rollout=2, max_steps=8)
    pending = PendingRollout(prompts, [[1, 2]], drawn_at=5, version=4, weights={}, run_state=drawn)
    pending.completions = completions
    scores = pending.score([FunctionReward("trl_rewards.first_digit")], warn_s=60)
    assert scores.metrics["reward/step_seen"] == 4.0 and scores.extra["parsed"] == ["3", "3", "4", "x"]
    buffer = io.BytesIO()
    torch.save(pending.state(), buffer)
    buffer.seek(0)
    saved = SavedRollout.from_state(torch.load(buffer, weights_only=True))
    assert saved.run_state == drawn and saved.scores.extra == scores.extra
    again = saved.pending(prompts, [[1, 2]])
    assert again.run_state == drawn and again.scores.extra == scores.extra


def test_an_older_checkpoint_without_them_still_loads():
    prompts, completions = rollout()
    pending = PendingRollout(prompts, [[1, 2]], drawn_at=5, version=4, weights={})
    pending.completions = completions
    pending.scores = Scores(torch.zeros(4), {}, torch.zeros(4), 0.1)
    state = pending.state()
    del state["run_state"], state["scores"]["extra"]
    saved = SavedRollout.from_state(state)
    assert saved.run_state == RunState(global_step=4) and saved.scores.extra == {}


def a_round(name: str, totals: list[list[float]], column: str | None) -> Round:
    """A scored round of prompts ``name0``...; its rewards logged ``column`` as ``"<prompt>.<k>"`` when given."""
    prompts = [Prompt(f"{name}{i}", "") for i in range(len(totals))]
    completions = [[Completion([i], f"{name}{i}.{k}", [0.0], "stop") for k in range(2)] for i in range(len(totals))]
    flat = torch.tensor([float(v) for group in totals for v in group])
    extra = {column: [c.text for group in completions for c in group]} if column else {}
    return Round(prompts, [[i] for i in range(len(totals))], completions, Scores(flat, {}, flat, 0.1, extra), 1.0)


def test_dynamic_sampling_keeps_each_groups_columns_with_it():
    first = a_round("a", [[1, 1], [0, 1]], "parsed")  # a0 has no variance

    def more(count, index, sample):
        return a_round("b", [[0, 2]] * count, None)  # a round whose rewards logged nothing

    chosen, _ = refill(first, more, 2, 2, 3, lambda values: values)
    assert [p.question for p in chosen.prompts] == ["a1", "b0"]
    assert chosen.scores.extra == {"parsed": ["a1.0", "a1.1", None, None]}
    groups = make_groups(chosen.prompts, chosen.prompt_ids, chosen.completions, chosen.scores.total,
                         chosen.scores.total, chosen.scores.correct, chosen.scores.extra)  # fmt: skip
    assert groups[0].extra == {"parsed": ["a1.0", "a1.1"]} and groups[1].extra == {"parsed": [None, None]}


def test_the_sample_table_shows_the_logged_columns():
    chosen = a_round("a", [[0, 1]], "parsed")
    groups = make_groups(chosen.prompts, chosen.prompt_ids, chosen.completions, chosen.scores.total,
                         chosen.scores.total, chosen.scores.correct, chosen.scores.extra)  # fmt: skip
    logger = RolloutSampleLogger()
    assert [row[-1] for row in logger.rows(groups)] == ["a0.0", "a0.1"]
    assert "parsed a0.1: `a0.1`" in logger.render(groups)


@pytest.mark.slow
def test_a_metric_only_some_processes_logged_is_averaged_over_those(tmp_path):
    """A reward's ``log_metric`` can run on one process only: the others must not hang or shift the other keys."""
    out = str(tmp_path / "means")
    mp.start_processes(ranks.mean_over, args=(free_port("127.0.0.1"), out), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        assert eval(Path(f"{out}.{rank}").read_text()) == {"reward/only_rank_1": 5.0, "shared": 0.5}  # noqa: S307


def test_a_run_logs_them_under_reward_and_in_the_sample_table(tmp_path, monkeypatch, capsys, caplog):
    """``amir fit`` (tiny model, HF engine, in this process), 3 rollouts of one step: the function sees the step and
    rollout each was sampled at, its metrics reach TensorBoard as ``reward/*``, its column the sample table."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "3", *HF_ENGINE]
    args += ["--data.rewards", '["trl_rewards.first_digit"]', "--trainer.check_val_every_n_epoch", "50"]
    run_here(args, tmp_path, monkeypatch, capsys, caplog)
    scalars = read_scalars(tmp_path / "runs")
    assert scalars["reward/step_seen"] == [0.0, 1.0, 2.0] and scalars["reward/rollout_seen"] == [0.0, 1.0, 2.0]
    assert scalars["reward/hit_rate"] == scalars["rollout/reward/first_digit"]
    events = next((tmp_path / "runs").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    table = accumulator.Tensors("rollout/samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert ", parsed " in table
