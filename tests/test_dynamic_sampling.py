"""Dynamic sampling (``data.rollout.dynamic_sampling``): groups without reward variance are dropped and more prompts
sampled, from the same weights, until each process has its groups with variance, within ``max_sampling_rounds``."""

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from helpers import ranks
from helpers.ranks import G, a_round
from helpers.refill import refill
from test_datamodule import Watch, build, cut_and_resume, make_trainer
from transformers import AutoModelForCausalLM

from amir_lightning.engines import VLLMServerEngine
from amir_lightning.helpers.serving import free_port
from amir_lightning.loop.collect import RolloutSettings
from amir_lightning.loop.dynamic import has_variance, needs_more, prompts_to_draw
from amir_lightning.rewards.base import Reward


def one_process(values: list[float]) -> list[float]:
    return values


def test_a_group_has_variance_when_its_rewards_are_finite_and_not_all_equal():
    scores = a_round("q", [[1.0, 1.0], [0.0, 1.0], [float("nan"), 1.0], [2.0, 2.0]]).scores
    assert has_variance(scores, G) == [False, True, False, False]


@pytest.mark.parametrize(
    ("kept", "sampled", "draw"), [(4, 4, 0), (5, 6, 0), (0, 4, 4), (2, 4, 4), (3, 4, 2), (1, 8, 4), (3, 5, 2)]
)
def test_a_round_draws_the_missing_groups_worth_of_prompts_at_the_share_seen(kept, sampled, draw):
    """4 groups wanted: 0 when full, all 4 when none had variance, else the missing ones over the share seen."""
    assert prompts_to_draw(4, kept, sampled) == draw


def test_rounds_go_on_until_the_groups_have_variance_and_keep_them_in_the_order_sampled():
    """4 wanted; round 0 has 1 with variance (draw 4 more at 1 in 4), round 1 has 2 (3 of 8 seen: draw 3), round 2
    gives the last one and one more, which is left out."""
    first = a_round("a", [[1, 1], [0, 1], [1, 1], [1, 1]])
    later = {1: a_round("b", [[0, 2], [3, 3], [5, 4], [0, 0]]), 2: a_round("c", [[1, 2], [2, 1], [7, 7]])}
    asked = []

    def more(count, index, sample):
        asked.append((count, index, sample))
        return later[index]

    chosen, metrics = refill(first, more, 4, G, 5, one_process)
    assert asked == [(4, 1, True), (3, 2, True)]  # and no round 3: full
    assert [p.question for p in chosen.prompts] == ["a1", "b0", "b2", "c0"]
    assert [c[0].text for c in chosen.completions] == ["a1.0", "b0.0", "b2.0", "c0.0"]
    assert chosen.scores.total.tolist() == [0, 1, 0, 2, 5, 4, 1, 2] and chosen.prompt_ids == [[1], [0], [2], [0]]
    assert chosen.scores.metrics == first.scores.metrics  # the uniform first round describes the policy
    assert chosen.generate_s == 6.0 and chosen.scores.seconds == 1.5
    assert metrics == {
        "rollout/sampling_rounds": 3.0,
        "rollout/kept_group_frac": 5 / 11,
        "rollout/zero_std_frac": 6 / 11,
    }


def test_when_the_rounds_run_out_the_rollout_is_filled_with_groups_the_step_drops():
    first = a_round("a", [[1, 1], [0, 1], [1, 1]])
    chosen, metrics = refill(first, lambda count, index, sample: a_round("b", [[2, 2]] * count), 3, G, 2, one_process)
    assert [p.question for p in chosen.prompts] == ["a1", "a0", "a2"]  # the one with variance first
    assert has_variance(chosen.scores, G) == [True, False, False]
    assert metrics["rollout/sampling_rounds"] == 2.0 and metrics["rollout/kept_group_frac"] == 1 / 6


def test_a_long_refill_says_where_it_stands_and_ends_at_a_stop(monkeypatch, caplog):
    """100,000 rounds allowed and none with variance: a line says the round and the key (every 30 s; here every
    round), and a SIGTERM that comes during round 3 ends the refill before round 4 with the run's SIGTERM exit.
    Before, 100 s went by without a line and the refill ran on past the signal."""
    from amir_lightning.helpers import stops
    from amir_lightning.loop import dynamic

    monkeypatch.setattr(dynamic, "PROGRESS_S", 0.0)
    asked = []

    def more(count, index, sample):
        asked.append(index)
        if index == 3:
            stops.request_stop("SIGTERM")  # what the run's signal handler does
        return a_round("b", [[2, 2]] * count)

    restore = stops.catch_stop_signals()
    try:
        with caplog.at_level("INFO"), pytest.raises(SystemExit) as stopped:
            refill(a_round("a", [[1, 1]] * 2), more, 2, G, 100_000, one_process)
    finally:
        restore()
    assert stopped.value.code == 143 and asked == [1, 2, 3]
    assert (
        "dynamic sampling: round 3 of at most 100000 (data.rollout.max_sampling_rounds): 0 of 2 groups" in caplog.text
    )


def test_one_round_is_the_rollout_as_sampled():
    first = a_round("a", [[1, 1], [0, 1]])
    chosen, metrics = refill(first, lambda *args: pytest.fail("no second round"), 2, G, 1, one_process)
    assert [p.question for p in chosen.prompts] == ["a1", "a0"] and metrics["rollout/sampling_rounds"] == 1.0


def test_a_further_round_is_needed_when_a_group_lacks_variance_on_some_process_and_rounds_are_left():
    """A rollout sampled ahead pushes its weights for the further rounds only then: a push waits for the rollouts in
    flight."""
    full, short = a_round("a", [[0, 1], [1, 0]]), a_round("a", [[0, 1], [1, 1]])
    assert not needs_more(full, 2, G, 4, one_process)
    assert needs_more(short, 2, G, 4, one_process) and not needs_more(short, 2, G, 1, one_process)
    assert needs_more(full, 2, G, 4, lambda values: [1.0])  # another process misses a group


@pytest.mark.slow  # two processes of its own
def test_every_process_runs_the_same_rounds_and_draws_alike(tmp_path):
    port = free_port("127.0.0.1")  # below the ephemeral range: no socket takes it meanwhile
    out = str(tmp_path / "ranks")
    # spawned: each process imports the helper alone (torch and the rollout's parts), not this file's imports
    mp.start_processes(ranks.refill_rounds, args=(port, out), nprocs=2, start_method="spawn")
    rank0, rank1 = (eval(Path(f"{out}.{rank}").read_text()) for rank in (0, 1))  # noqa: S307 (our own repr)
    # round 1: rank 1 needs 2 (none seen with variance); round 2: rank 1 has 1 of 4, needs ceil(1 * 4 / 1) > 2: 2
    assert rank0[0] == [(2, 1, False), (2, 2, False)] and rank1[0] == [(2, 1, True), (2, 2, True)]
    assert rank0[1] == ["a0", "a1"] and rank1[1] == ["b1", "b1"]
    assert rank0[2]["rollout/sampling_rounds"] == rank1[2]["rollout/sampling_rounds"] == 3.0


class VariesOnOddAnswers(Reward):
    """A group of a prompt with an even answer always scores 1 (no variance); an odd one, its completion's length
    plus its first character's code: about half the groups of the tiny random policy have no variance."""

    def score(self, completions, answers, **kwargs) -> list[float]:
        return [1.0 if int(a) % 2 == 0 else float(len(c) + ord((c or " ")[0])) for c, a in zip(completions, answers)]


def build_dynamic(tmp_path, dynamic: bool = True, rounds: int = 6):
    settings = RolloutSettings(group_size=4, prompts_per_process=4, micro_batch_groups=2, dynamic_sampling=dynamic,
                               drop_zero_std_groups=True, max_sampling_rounds=rounds)  # fmt: skip
    module, data = build(tmp_path, rollout=settings, new_tokens=3)
    data.rewards = [VariesOnOddAnswers()]
    return module, data


class Logged(Watch):
    """Also each rollout's ``rollout/`` metrics as logged."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")})


def test_a_run_with_dynamic_sampling_trains_full_steps_where_dropping_alone_shrinks_them(tmp_path):
    """The same prompts and weights: dropping alone trains the groups with variance the first round had; dynamic
    sampling draws more prompts and trains prompts_per_process groups, all with variance."""
    runs = {}
    for dynamic in (False, True):
        module, data = build_dynamic(tmp_path / str(dynamic), dynamic)
        logged = Logged()
        make_trainer(tmp_path / str(dynamic), 2, [logged]).fit(module, datamodule=data)
        runs[dynamic] = (logged.metrics, data.feed.position)
        data.engine.close()
    (dropped, dropped_at), (dynamic, dynamic_at) = runs[False], runs[True]
    # rollout 1 drew 4 prompts with odd answers, rollout 2 two with even ones: dropping trains 4 groups, then 2
    assert dropped_at == 8 and [m["rollout/groups_kept"] for m in dropped] == [4, 2]
    assert [m["rollout/groups_kept"] for m in dynamic] == [4, 4] and dynamic_at > 8  # rollout 2 drew more prompts
    assert [m["rollout/sampling_rounds"] for m in dynamic] == [1, 4] and "rollout/sampling_rounds" not in dropped[1]
    assert dynamic[0]["rollout/kept_group_frac"] == 1 and 0 < dynamic[1]["rollout/kept_group_frac"] < 0.5
    assert dynamic[1]["rollout/zero_std_frac"] == pytest.approx(1 - dynamic[1]["rollout/kept_group_frac"])
    for key in ("rollout/reward_mean", "rollout/zero_std_frac"):  # the same first rollout, one round
        assert dropped[0][key] == dynamic[0][key]


class Steps(L.Callback):
    """Each rollout's ``train/steps_in_rollout`` as logged, and the LR each step trained with."""

    def __init__(self) -> None:
        self.in_rollout, self.lrs = [], []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.in_rollout.append(float(trainer.callback_metrics["train/steps_in_rollout"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_a_rollout_with_fewer_groups_than_steps_keeps_its_step_count_and_the_lr_schedule(tmp_path, caplog):
    """4 steps a rollout, groups without variance dropped: rollout 1 keeps 4 groups, rollout 2 two. Both take 4
    steps (2 of rollout 2's leave the weights as they are), so the run takes its 8 planned steps and the linear LR
    schedule ends where it was planned to; one line names the rollout and the key. Before, rollout 2 took 2 steps:
    6 of 8, the schedule ended at 75 % of its horizon, and only rollout/groups_kept said so."""
    settings = RolloutSettings(group_size=4, prompts_per_process=4, micro_batch_groups=2, steps_per_rollout=4,
                               drop_zero_std_groups=True)  # fmt: skip
    module, data = build(tmp_path, rollout=settings, new_tokens=3)
    data.rewards = [VariesOnOddAnswers()]
    module.scheduler_factory = lambda optimizer: torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=8)
    steps = Steps()
    trainer = make_trainer(tmp_path, 2, [steps])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 8 and steps.in_rollout == [4.0, 2.0]
    assert steps.lrs == pytest.approx([0.5 * (1 - k / 8) for k in range(8)])
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8  # at the end of its horizon
    assert (
        "rollout 2: data.rollout.drop_zero_std_groups left 2 group(s) with reward variance, fewer than its 4 "
        "steps (data.rollout.steps_per_rollout): 2 step(s) train, the other 2 leave the weights" in caplog.text
    )


class NeverVaries(Reward):
    """Every completion scores 0: no group ever has reward variance (a reward that never fires)."""

    def score(self, completions, answers, **kwargs) -> list[float]:
        return [0.0] * len(completions)


def test_a_rollout_whose_rounds_find_no_group_with_variance_trains_nothing_and_the_run_goes_on(tmp_path, caplog):
    """A reward that is always 0, dynamic sampling with 2 rounds: each of the 3 rollouts finds no group to train on.
    Its 2 steps leave the weights as they are, the run goes on to its last rollout, and a line a rollout names
    data.rollout.max_sampling_rounds. Before, Lightning's "No training batches" ended the fit after rollout 1 and the
    run exported its untrained policy as if it had finished."""
    settings = RolloutSettings(group_size=4, prompts_per_process=2, micro_batch_groups=1, steps_per_rollout=2,
                               dynamic_sampling=True, max_sampling_rounds=2)  # fmt: skip
    module, data = build(tmp_path, rollout=settings, new_tokens=3)
    data.rewards = [NeverVaries()]
    steps = Steps()
    trainer = make_trainer(tmp_path, 3, [steps])
    trainer.fit(module, datamodule=data)
    assert trainer.current_epoch == 3 and trainer.global_step == 6 and steps.in_rollout == [0.0, 0.0, 0.0]
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(start[k], v) for k, v in module.model.state_dict().items())  # the weights stayed
    line = "dynamic sampling found 0 group(s) with reward variance within data.rollout.max_sampling_rounds (2)"
    assert caplog.text.count(line) == 3


def test_a_run_with_dynamic_sampling_resumed_at_a_rollouts_end_ends_where_an_uninterrupted_run_does(tmp_path):
    (straight_module, straight), (module, data) = cut_and_resume(build_dynamic, tmp_path, 2)
    assert data.feed.position == straight.feed.position > 8  # the further rounds' prompts, drawn again alike
    for name, weight in straight_module.model.state_dict().items():
        assert torch.equal(weight, module.model.state_dict()[name]), name


def test_dynamic_sampling_ahead_is_refused_with_the_old_weights_of_the_first_round():
    with pytest.raises(ValueError, match="data.rollout.dynamic_sampling with data.rollout.max_staleness needs "
                       "data.rollout.stale_logps current"):  # fmt: skip
        RolloutSettings(dynamic_sampling=True, max_staleness=1, stale_logps="sampler")
    with pytest.raises(ValueError, match="data.rollout.max_sampling_rounds"):
        RolloutSettings(dynamic_sampling=True, max_sampling_rounds=0)


def build_dynamic_ahead(tmp_path, url: str):
    """``build_dynamic``, sampled a rollout ahead by the vLLM server at ``url``."""
    engine = VLLMServerEngine(url=url, max_model_len=64)
    settings = RolloutSettings(group_size=4, prompts_per_process=4, micro_batch_groups=2, dynamic_sampling=True,
                               max_sampling_rounds=6, max_staleness=1)  # fmt: skip
    module, data = build(tmp_path, engine=engine, rollout=settings, new_tokens=3)
    data.rewards = [VariesOnOddAnswers()]
    return module, data


class RefillCursors(L.Callback):
    """Per epoch: the refill stream's position at its end, and the one a checkpoint written at its start holds (its
    rollout taken and refilled, none of its steps started: SLURM's requeue checkpoint can come then)."""

    def __init__(self) -> None:
        self.at_end, self.saved_at_start = [], []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.saved_at_start.append(trainer.datamodule.state_dict()["refill_cursor"])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.at_end.append(trainer.datamodule.feed.refill_position)


@pytest.mark.slow
def test_a_rollout_sampled_ahead_is_refilled_from_the_weights_it_trains_and_resumes_alike(tmp_path, served):
    """Each epoch's rollout was sampled by the weights before; its further rounds, drawn from the refill stream,
    sample from the weights it trains (staleness 0 on their tokens). Resumed after a rollout, the saved rollout ahead
    is refilled again alike: the run ends with the uninterrupted run's weights and stream positions. A checkpoint
    written before a refilled rollout's steps start holds the refill stream where that rollout's rounds began (its
    resume runs the rollout again, rounds and all)."""
    straight_module, straight = build_dynamic_ahead(tmp_path / "straight", served.tiny_url())
    logged, cursors = Logged(), RefillCursors()
    make_trainer(tmp_path / "straight", 3, [logged, cursors], checkpoints=True, keep_all=True).fit(
        straight_module, datamodule=straight
    )
    straight.engine.close()
    assert [m["rollout/groups_kept"] for m in logged.metrics] == [4, 4, 4]
    refilled = [m for m in logged.metrics[1:] if m["rollout/sampling_rounds"] > 1]
    assert refilled, [m["rollout/sampling_rounds"] for m in logged.metrics]
    for metrics in refilled:  # the first round's tokens one update old, the further rounds' none
        assert 0 < metrics["rollout/staleness_steps"] < 1 and metrics["rollout/staleness_steps_max"] == 1
    assert straight.feed.position == 4 * 4  # 3 rollouts trained and 1 ahead: the main stream as without refills
    assert cursors.saved_at_start == [0, *cursors.at_end[:-1]] and cursors.at_end[-1] > 0
    (after_one,) = (tmp_path / "straight" / "ckpt").glob("epoch=1-*.ckpt")
    module, data = build_dynamic_ahead(tmp_path / "resumed", served.tiny_url())
    make_trainer(tmp_path / "resumed", 3, []).fit(module, datamodule=data, ckpt_path=after_one)
    data.engine.close()
    assert (data.feed.position, data.feed.refill_position) == (straight.feed.position, straight.feed.refill_position)
    for key, weight in straight_module.model.state_dict().items():
        assert torch.equal(weight, module.model.state_dict()[key]), key
