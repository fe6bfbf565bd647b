"""Users bring their own rewards: plain functions with TRL's signature, the dataset's columns by name, None."""

import json
import textwrap
from pathlib import Path

import pytest
from conftest import read_scalars, run_amir

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.loop.rewarding import score_completions
from amir_lightning.rewards import FunctionReward, MathAnswerReward, Reward, RewardInputs

ROOT = Path(__file__).parents[1]


def rollout(conversational=False):
    columns = {"prompt": "3=", "solution": "3", "level": 7}
    messages = ({"role": "user", "content": "3="},) if conversational else None
    prompt = Prompt("3=", "3", {}, messages, columns)
    completions = [[Completion([3], "3", [-0.1], "stop"), Completion([4, 4], "44", [-0.1, -0.2], "length")]]
    return [prompt], completions


class Recorder(Reward):
    """A ``Reward`` class that takes the keyword arguments too."""

    def score(self, completions, answers, **kwargs):
        self.seen = kwargs
        return [1.0] * len(completions)


def test_every_reward_sees_trl_keyword_arguments():
    prompts, completions = rollout()
    recorder = Recorder()
    score_completions([recorder], prompts, completions)
    seen = recorder.seen
    assert seen["level"] == [7, 7] and seen["solution"] == ["3", "3"]  # the dataset's columns, by name
    assert seen["answer"] == ["3", "3"] and "prompt" not in seen  # the reference; TRL passes the prompt as prompts
    assert seen["prompts"] == ["3=", "3="] and seen["completion_ids"] == [[3], [4, 4]]
    assert seen["finish_reasons"] == ["stop", "length"]


def test_conversational_completions_reach_functions_as_assistant_messages():
    prompts, completions = rollout(conversational=True)
    inputs = RewardInputs(["3", "44"], prompts * 2, [[3], [4, 4]], ["stop", "length"])
    assert inputs.trl_completions()[1] == [{"role": "assistant", "content": "44"}]
    assert inputs.kwargs()["prompts"][0] == [{"role": "user", "content": "3="}]


def test_none_means_does_not_apply(tmp_path, monkeypatch):
    module = tmp_path / "none_rewards.py"
    module.write_text(
        textwrap.dedent(
            """
            def only_stopped(completions, finish_reasons, **kwargs):
                return [1.0 if r == "stop" else None for r in finish_reasons]

            def never(completions, **kwargs):
                return [None] * len(completions)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts, completions = rollout()
    total, metrics, _, _ = score_completions(
        [FunctionReward("none_rewards.only_stopped", weight=2.0), FunctionReward("none_rewards.never")],
        prompts,
        completions,
    )
    assert total.tolist() == [2.0, 0.0]  # None adds nothing: not NaN (the group would be dropped), not a score of 0
    assert metrics["rollout/reward/only_stopped"] == 1.0  # the mean over the completions it applies to
    assert "rollout/reward/never" not in metrics and metrics["rollout/nonfinite_rewards"] == 0
    assert metrics["rollout/unscored"] == 1.0  # the truncated one: no reward applied


def test_the_math_reward_does_not_apply_without_a_reference():
    prompt = Prompt("3=", "", {}, None, {"prompt": "3="})
    grader = MathAnswerReward()
    try:
        total, metrics, correct, _ = score_completions([grader], [prompt], [[Completion([3], "3", [-0.1], "stop")]])
    finally:
        grader.close()
    assert total.tolist() == [0.0] and correct.isnan().all() and metrics["rollout/unscored"] == 1.0


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nowhere.fn", "cannot import 'nowhere' for the reward function 'nowhere.fn'"),
        ("json.no_such_function", "json has no function 'no_such_function'"),
        ("justaname", "'justaname' is not a dotted path to a function"),
    ],
)
def test_a_reward_function_that_cannot_be_found_is_named(path, message):
    with pytest.raises(ValueError, match="data.rewards") as err:
        FunctionReward(path)
    assert message in str(err.value)


def test_a_reward_returning_the_wrong_things_is_named(tmp_path, monkeypatch):
    (tmp_path / "odd_rewards.py").write_text(
        "def short(completions, **kwargs):\n    return [1.0]\n\n"
        "def text(completions, **kwargs):\n    return ['good'] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts, completions = rollout()
    with pytest.raises(ValueError, match=r"reward short returned 1 scores for 2 completions"):
        score_completions([FunctionReward("odd_rewards.short")], prompts, completions)
    with pytest.raises(ValueError, match=r"reward text returned 'good' for completion 0: expected a number or None"):
        score_completions([FunctionReward("odd_rewards.text")], prompts, completions)


@pytest.mark.slow
def test_a_trl_reward_function_from_yaml_gets_the_dataset_column(tmp_path):
    """``amir fit`` with a plain function in a module next to the config: no PYTHONPATH, the column arrives."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import json

            def by_level(completions, level, prompts, completion_ids, finish_reasons, **kwargs):
                with open("seen.jsonl", "a") as out:
                    out.write(json.dumps({"level": level, "prompts": prompts, "ids": completion_ids,
                                          "finish": finish_reasons, "keys": sorted(kwargs)}) + "\\n")
                return [lv / 10 for lv in level]
            """
        )
    )
    rows = [{"prompt": f"{d}=", "answer": str(d), "level": d} for d in range(10)]
    (tmp_path / "digits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = (ROOT / "configs" / "tiny.yaml").read_text()
    config = config.replace(
        "    - class_path: amir_lightning.rewards.MathAnswerReward\n",
        "    - class_path: amir_lightning.rewards.MathAnswerReward\n    - my_rewards.by_level\n",
    )
    config = config.replace(
        "    class_path: amir_lightning.data.ArithmeticPrompts\n"
        '    init_args: {num_terms: 1, min_value: 0, max_value: 9, template: "{expression}=", split: all}\n',
        "    class_path: amir_lightning.data.JsonlPrompts\n    init_args: {path: digits.jsonl}\n",
    )
    (tmp_path / "mine.yaml").write_text(config)
    args = ["fit", "--config", "mine.yaml", "--trainer.max_epochs", "2", "--data.rollout.prompts_per_process", "4"]
    args += ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]
    run_amir(args, tmp_path, console_script=True)  # the HF engine: the process never imports vLLM
    calls = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one call per rollout
    for call in calls:
        assert len(call["level"]) == 4 * 8  # every completion, its row's column
        assert all(call["prompts"][i] == f"{call['level'][i]}=" for i in range(32))
        assert all(len(ids) >= 1 for ids in call["ids"]) and set(call["finish"]) <= {"stop", "length"}
        assert "answer" in call["keys"]  # the dataset's answer column, by name
    rewards = read_scalars(tmp_path / "runs" / "tiny")["rollout/reward/by_level"]
    assert len(rewards) == 2 and all(0.0 <= r <= 0.9 for r in rewards)


class Sleeps(Reward):
    """A plain (synchronous) reward that takes a while and records when it ran."""

    def score(self, completions, answers, **kwargs):
        import time

        start = time.monotonic()
        time.sleep(0.4)
        self.ran = (start, time.monotonic())
        return [0.5] * len(completions)


def test_async_reward_functions_run_concurrently_with_each_other_and_the_rest(tmp_path, monkeypatch):
    """Two ``async def`` functions (each awaiting 0.4 s, as a call to a remote service would) and a synchronous
    reward of 0.4 s: their times overlap, so the rollout waits about 0.4 s, not 1.2 s, and each score lands in its
    own reward's place."""
    (tmp_path / "async_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio, time

            RAN = {}

            async def remote_a(completions, **kwargs):
                start = time.monotonic()
                await asyncio.sleep(0.4)
                RAN["a"] = (start, time.monotonic())
                return [1.0 for _ in completions]

            async def remote_b(completions, completion_ids, **kwargs):
                start = time.monotonic()
                await asyncio.gather(*(asyncio.sleep(0.4) for _ in completions))  # one request per completion
                RAN["b"] = (start, time.monotonic())
                return [float(len(ids)) for ids in completion_ids]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import async_rewards

    prompts, completions = rollout()
    rewards = [FunctionReward("async_rewards.remote_a"), Sleeps(), FunctionReward("async_rewards.remote_b", weight=2)]
    assert [r.concurrent for r in rewards] == [True, False, True]
    total, metrics, _, _ = score_completions(rewards, prompts, completions)
    assert total.tolist() == [1.0 + 0.5 + 2 * 1, 1.0 + 0.5 + 2 * 2]
    assert metrics["rollout/reward/remote_b"] == 1.5 and metrics["rollout/reward/sleeps"] == 0.5
    spans = [async_rewards.RAN["a"], rewards[1].ran, async_rewards.RAN["b"]]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all three were running at one moment


def test_an_async_reward_that_raises_is_named(tmp_path, monkeypatch):
    (tmp_path / "async_bad.py").write_text("async def broken(completions, **kwargs):\n    raise KeyError('score')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from amir_lightning.rewards.base import RewardError

    prompts, completions = rollout()
    with pytest.raises(RewardError, match=r"reward broken \(.*async_bad.py:2\) raised KeyError"):
        score_completions([FunctionReward("async_bad.broken"), Sleeps()], prompts, completions)
