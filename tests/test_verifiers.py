"""Environments from verifiers 0.4 (``rollout/verifiers_env.py``): a taskset written for prime-rl, built here from
in-memory rows (``tests/helpers/vf_sums``, with an ``add`` tool served by verifiers as an MCP server, and
``tests/helpers/vf_digits``), runs its episodes through the policy and scores them with its own rewards.

The scripted-policy tests use the character-level ChatML tokenizer and template of ``tests/test_tools.py``. The tests
whose episodes run (verifiers starts the tool servers as processes) are in the slow tier.
"""

import os
from importlib.util import find_spec
from pathlib import Path

import pytest
from test_tools import EOS, SAMPLING, TEMPLATE, TOKENIZER, call

from amir_lightning.data.templates import ChatFormat
from amir_lightning.data.verifiers_tasks import VerifiersTasks
from amir_lightning.rollout import Completion
from amir_lightning.rollout.replies import tool_metrics
from amir_lightning.rollout.verifiers_env import VerifiersEnvironment

# Looked up, not imported: collecting the suite in each worker need not pay verifiers' import (4 s).
pytestmark = pytest.mark.skipif(find_spec("verifiers") is None, reason="needs the verifiers extra")
HELPERS = str(Path(__file__).parent / "helpers")


@pytest.fixture(scope="module")
def sums():
    """``vf_sums`` served (its tool server started once), prepared for the ChatML tokenizer; closed after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(HELPERS)  # the taskset's module, here and in its tool server's process
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
        env = VerifiersEnvironment("vf_sums", max_turns=3)
        chat = ChatFormat(template=TEMPLATE, tools=env.tool_schemas())
        env.prepare(TOKENIZER, chat)
        yield env, chat, VerifiersTasks("vf_sums")
        env.close()


def scripted(turns):
    """A policy that writes ``turns[t]`` at turn ``t`` (each ended by its end-of-turn token); it records its inputs."""
    seen = []

    def generate(ids, count, sampling, turn):
        seen.append((turn, [list(i) for i in ids]))
        text = turns[min(turn, len(turns) - 1)]
        own = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]
        return [[Completion(list(own), text, [-0.5] * len(own), "stop") for _ in range(count)] for _ in ids]

    return generate, seen


@pytest.mark.slow  # verifiers serves the taskset's tool server from a process of its own
def test_an_episode_is_the_conversation_the_template_writes_and_the_taskset_scores_it(sums):
    """Two prompts x 2 episodes: each calls ``add`` on the taskset's tool server, reads 7 or 8, answers. The episode's
    tokens (prompt included) are the template's rendering of the whole conversation, token for token; only the
    policy's two turns are trained on; each turn of all four episodes is sampled in one batch; the taskset's reward
    (the answer in the last reply) and metric come with each completion."""
    env, chat, tasks = sums
    prompts = [tasks[0], tasks[1]]
    prompt_ids = [chat.render(TOKENIZER, p) for p in prompts]
    first = "Adding.\n" + call("add", '{"a": 3, "b": 4}')
    generate, seen = scripted([first, "It is 7."])
    groups = env.episodes(prompts, prompt_ids, 2, SAMPLING, generate, TOKENIZER)
    assert [turn for turn, _ in seen] == [0, 1] and [len(ids) for _, ids in seen] == [4, 4]  # one batch a turn
    assert seen[0][1] == [prompt_ids[0]] * 2 + [prompt_ids[1]] * 2
    for prompt, ids, group, reward in zip(prompts, prompt_ids, groups, (1.0, 0.0)):
        assert len(group) == 2
        for c in group:
            conversation = [
                *prompt.messages,
                {"role": "assistant", "content": "Adding.",
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
                {"role": "tool", "name": "add", "content": "7"},
                {"role": "assistant", "content": "It is 7."},
            ]  # fmt: skip
            whole = TOKENIZER(chat.text(TOKENIZER, conversation, False), add_special_tokens=False)["input_ids"]
            assert ids + c.token_ids == whole[: len(ids) + len(c.token_ids)]
            own = TOKENIZER(first, add_special_tokens=False)["input_ids"] + [EOS]
            trained = [t for t, m in zip(c.token_ids, c.loss_mask) if m]
            assert trained == own + TOKENIZER("It is 7.", add_special_tokens=False)["input_ids"] + [EOS]
            assert c.outcome == {"reward": reward, "rewards": {"correct": reward}, "metrics": {"reply_chars": 8.0}}
            assert c.turns == 2 and c.tool_calls == 1 and not c.tool_cut and c.finish_reason == "stop"
            assert c.calls == [{"name": "add", "arguments": {"a": 3, "b": 4}, "result": "7", "error": False,
                                "seconds": 0.0}]  # fmt: skip
    metrics = tool_metrics([c for g in groups for c in g])
    assert metrics["tools/call_frac"] == 1.0 and metrics["tools/error_frac"] == 0.0


@pytest.mark.slow  # verifiers serves the taskset's tool server from a process of its own
def test_an_episode_still_calling_at_max_turns_is_cut_and_scored(sums):
    """A policy that calls ``add`` at every turn: verifiers ends the episode at ``max_turns`` (3), the episode counts
    as cut (``tools/cut_frac``), holds its three turns and two results, and the taskset still scores it (0: the last
    reply holds no answer)."""
    env, chat, tasks = sums
    prompt_ids = [chat.render(TOKENIZER, tasks[0])]
    generate, seen = scripted([call("add", '{"a": 3, "b": 4}')])
    (group,) = env.episodes([tasks[0]], prompt_ids, 1, SAMPLING, generate, TOKENIZER)
    (c,) = group
    assert len(seen) == 3 and c.turns == 3 and c.tool_calls == 3 and len(c.calls) == 2 and c.tool_cut
    assert c.outcome["reward"] == 0.0 and tool_metrics(group)["tools/cut_frac"] == 1.0


def test_wrong_settings_are_one_line_naming_the_key(sums, tmp_path):
    """A harness that runs a program of its own, a taskset that cannot be imported, and prompts that are not the
    taskset's tasks are each refused in one line naming the key."""
    from amir_lightning.data.base import Prompt

    with pytest.raises(ValueError, match=r"^data.environment.init_args.environment: the harness 'codex' runs a prog"):
        VerifiersEnvironment({"taskset": {"id": "vf_sums"}, "agent": {"harness": {"id": "codex"}}})
    with pytest.raises(ValueError, match=r"^data.prompts.init_args.environment: the verifiers taskset 'no_such_ta"):
        VerifiersTasks("no_such_taskset")
    env, chat, _ = sums
    stray = Prompt("What is 3 + 4?", "7")
    with pytest.raises(ValueError, match=r"is not a task of the verifiers taskset 'vf_sums': give data.prompts"):
        env.episodes([stray], [chat.render(TOKENIZER, stray)], 1, SAMPLING, scripted(["7"])[0], TOKENIZER)


@pytest.mark.slow
def test_a_verifiers_taskset_trains_for_three_rollouts(tmp_path, monkeypatch, capsys, caplog):
    """configs/tiny.yaml with ``vf_digits`` (write the digit asked for; the taskset's reward: the digit in the reply)
    as prompts, environment and reward, in-process vLLM: 3 rollouts of 16 tasks x 8 episodes, every sync verified;
    the taskset's reward is what trains (``rollout/reward/environment``), logged by name (``reward/correct``), and
    rises from the first rollout to the last; validation reports it on held-out tasks (``val/environment_reward``)."""
    from conftest import read_scalars, run_here

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
    tasks = "{class_path: amir_lightning.data.VerifiersTasks, init_args: {environment: vf_digits}}"
    args = ["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), "--trainer.max_epochs", "3"]
    args += ["--data.prompts", tasks, "--data.val_prompts", tasks, "--data.rewards", "[EnvironmentReward]"]
    args += ["--data.environment", "{class_path: VerifiersEnvironment, init_args: {environment: vf_digits}}"]
    args += ["--trainer.check_val_every_n_epoch", "3", "--data.evaluation.val_size", "4"]
    result = run_here(args, tmp_path, monkeypatch, capsys, caplog)
    assert "/v1/chat/completions" not in result.stderr  # verifiers' server and client log each call at INFO: quiet
    scalars = read_scalars(tmp_path / "runs" / "tiny" / "version_0")
    reward = scalars["rollout/reward_mean"]
    print(f"vf_digits: the taskset's reward per rollout {[round(r, 3) for r in reward]}")
    assert len(reward) == 3 and scalars["reward/correct"] == pytest.approx(reward)
    assert scalars["rollout/reward/environment"] == pytest.approx(reward) and reward[-1] > reward[0]
    assert max(scalars["rollout/sync_logp_diff"]) < 1e-3 and scalars["tools/turns"] == [1.0, 1.0, 1.0]
    (held_out,) = scalars["val/environment_reward"]  # the taskset's reward on 4 held-out tasks x 8, after rollout 3
    print(f"vf_digits: held-out taskset reward after rollout 3 {held_out:.3f}")
    assert 0.0 <= held_out <= 1.0 and len(scalars["val/accuracy"]) == 1


@pytest.mark.slow
def test_a_run_on_a_verifiers_taskset_stopped_and_resumed_ends_with_the_uninterrupted_runs_weights(
    tmp_path, monkeypatch, capsys, caplog
):
    """4 rollouts of ``vf_digits`` in one run, and 2 + 2 resumed from last.ckpt (HF engine, in this process): the
    same weights, bitwise. Episodes run by verifiers are a function of the weights and the run's place, as others."""
    from conftest import HF_ENGINE, run_here, stop_and_resume

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
    tasks = "{class_path: amir_lightning.data.VerifiersTasks, init_args: {environment: vf_digits}}"
    common = ["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), *HF_ENGINE]
    common += ["--data.prompts", tasks, "--data.val_prompts", tasks, "--data.rewards", "[EnvironmentReward]"]
    common += ["--data.environment", "{class_path: VerifiersEnvironment, init_args: {environment: vf_digits}}"]
    common += ["--trainer.check_val_every_n_epoch", "50", "--data.rollout.prompts_per_process", "4"]
    stop_and_resume(lambda args: run_here(args, tmp_path, monkeypatch, capsys, caplog), tmp_path, common)


def test_an_environment_verifiers_loaded_is_taken_as_it_is_with_its_chat_loop_run_here(sums):
    """``vf.load_environment(...)`` handed over in Python: its taskset and tools are the same, its ``null`` harness
    (verifiers' chat loop) is run by this project's, in this process."""
    import verifiers.v1 as vf

    loaded = vf.load_environment(
        vf.resolve_env_config({"taskset": {"id": "vf_sums"}, "agent": {"harness": {"id": "null"}}})
    )
    env = VerifiersEnvironment(loaded, max_turns=2)
    assert env.tool_schemas() == sums[0].tool_schemas() and len(env.tasks) == 2
    assert env.config.agent.harness.id == "amir_lightning_harness" and env.config.agent.max_turns == 2


@pytest.mark.slow
def test_a_tool_server_of_each_task_starts_with_each_episode_and_serves_its_calls(sums, monkeypatch):
    """``vf_sums_each``: the ``add`` server is the task's (``Task.toolsets``), started by verifiers for each episode
    and gone after it; its tools are shown at start as the shared ones are, and the episode reads its result."""
    env_shared, chat, _ = sums
    monkeypatch.syspath_prepend(HELPERS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
    env = VerifiersEnvironment("vf_sums_each", max_turns=3)
    assert env.tool_schemas() == env_shared.tool_schemas()
    env.prepare(TOKENIZER, chat)
    tasks = VerifiersTasks("vf_sums_each")
    generate, _ = scripted([call("add", '{"a": 2, "b": 6}'), "It is 8."])
    try:
        (group,) = env.episodes([tasks[1]], [chat.render(TOKENIZER, tasks[1])], 2, SAMPLING, generate, TOKENIZER)
    finally:
        env.close()
    assert [c.calls[0]["result"] for c in group] == ["8", "8"] and [c.outcome["reward"] for c in group] == [1.0, 1.0]
