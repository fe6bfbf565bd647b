"""Environments from verifiers 0.4 (``amir_lightning/environments/verifiers/``): a taskset written for prime-rl, built
here from in-memory rows (``tests/helpers/vf_sums``, with an ``add`` tool served by verifiers as an MCP server, and
``tests/helpers/vf_digits``), runs its episodes through the policy and scores them with its own rewards; a reward of
``tests/helpers/vf_faults`` that raises, returns junk or hangs is named, and a stop ends the wait on it.

The scripted-policy tests use the character-level ChatML tokenizer and template of ``tests/test_tools.py``. The tests
whose episodes run (verifiers starts the tool servers as processes) are in the slow tier.
"""

import os
from importlib.util import find_spec
from pathlib import Path

import pytest
from helpers.scripted import Scripted
from test_tools import EOS, SAMPLING, TEMPLATE, TOKENIZER, call

from amir_lightning.data.templates import ChatFormat
from amir_lightning.data.verifiers_tasks import VerifiersTasks
from amir_lightning.engines import Completion
from amir_lightning.environments.base import EpisodeBatch
from amir_lightning.environments.replies import tool_metrics
from amir_lightning.environments.verifiers.environment import VerifiersEnvironment

# Looked up, not imported: collecting the suite in each worker need not pay verifiers' import (4 s).
pytestmark = pytest.mark.skipif(find_spec("verifiers") is None, reason="needs the verifiers extra")
HELPERS = str(Path(__file__).parent / "helpers")


def prepared(taskset: str, **settings):
    """``taskset`` (its tool server started once, at its first episode), prepared for the ChatML tokenizer; closed
    after. Yields the environment, the chat format and the tasks."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(HELPERS)  # the taskset's module, here and in its tool server's process
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
        env = VerifiersEnvironment(taskset, **settings)
        chat = ChatFormat(template=TEMPLATE, tools=env.tool_schemas())
        env.prepare(TOKENIZER, chat)
        yield env, chat, VerifiersTasks(taskset)
        env.close()


@pytest.fixture(scope="module")
def sums():
    """``vf_sums`` served, prepared for the ChatML tokenizer; closed after."""
    yield from prepared("vf_sums", max_turns=3)


@pytest.fixture(scope="module")
def results():
    """``vf_results`` (tools ``garbled`` and ``dump``) served, results cut at 64 tokens; closed after."""
    yield from prepared("vf_results", max_turns=2, max_reply_tokens=64)


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
    groups = env.episodes(EpisodeBatch(prompts, prompt_ids, 2, SAMPLING, Scripted(generate), None, TOKENIZER))
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
            assert c.episode.outcome == {
                "reward": reward,
                "rewards": {"correct": reward},
                "metrics": {"reply_chars": 8.0},
            }
            assert (
                c.episode.turns == 2
                and c.episode.tool_calls == 1
                and not c.episode.tool_cut
                and c.finish_reason == "stop"
            )
            assert c.episode.calls == [{"name": "add", "arguments": {"a": 3, "b": 4}, "result": "7", "error": False,
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
    (group,) = env.episodes(EpisodeBatch([tasks[0]], prompt_ids, 1, SAMPLING, Scripted(generate), None, TOKENIZER))
    (c,) = group
    assert (
        len(seen) == 3
        and c.episode.turns == 3
        and c.episode.tool_calls == 3
        and len(c.episode.calls) == 2
        and c.episode.tool_cut
    )
    assert c.episode.outcome["reward"] == 0.0 and tool_metrics(group)["tools/cut_frac"] == 1.0


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
        env.episodes(
            EpisodeBatch(
                [stray], [chat.render(TOKENIZER, stray)], 1, SAMPLING, Scripted(scripted(["7"])[0]), None, TOKENIZER
            )
        )


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
        (group,) = env.episodes(
            EpisodeBatch(
                [tasks[1]], [chat.render(TOKENIZER, tasks[1])], 2, SAMPLING, Scripted(generate), None, TOKENIZER
            )
        )
    finally:
        env.close()
    assert [c.episode.calls[0]["result"] for c in group] == ["8", "8"] and [
        c.episode.outcome["reward"] for c in group
    ] == [1.0, 1.0]


@pytest.fixture
def faulty(monkeypatch):
    """``make(fault, reward_warn_s, **config)``: 2 episodes of task 7 of ``vf_faults`` with ``fault`` (its reward
    ``parsed_digit`` raises, returns ``None`` or hangs 20 s), the policy answering "seven", to run; closed after."""
    monkeypatch.syspath_prepend(HELPERS)
    made = []

    def make(fault: str, reward_warn_s: float | None = None, **config):
        config = {"taskset": {"id": "vf_faults", "task": {"fault": fault, "hang_s": 20.0}}, **config}
        warn = {} if reward_warn_s is None else {"reward_warn_s": reward_warn_s}
        env = VerifiersEnvironment(config, max_turns=1, **warn)
        chat = ChatFormat(template=TEMPLATE)
        env.prepare(TOKENIZER, chat)
        made.append(env)
        task = VerifiersTasks(config)[7]
        policy, ids = Scripted(scripted(["seven"])[0]), [chat.render(TOKENIZER, task)]
        return lambda: env.episodes(EpisodeBatch([task], ids, 2, SAMPLING, policy, None, TOKENIZER))

    yield make
    for env in made:
        env.close()


REWARD_FAULTS = [
    ("raises", "(tests/helpers/vf_faults/__init__.py:27) raised ValueError: invalid literal for int() with base 10: "
               "'seven' (task '7=')"),
    ("returns_none", "(tests/helpers/vf_faults/__init__.py:23) returned None: expected a number (task '7=')"),
]  # fmt: skip


@pytest.mark.parametrize(("fault", "said"), REWARD_FAULTS, ids=[f for f, _ in REWARD_FAULTS])
def test_a_taskset_reward_that_raises_or_returns_junk_is_named_with_its_error(fault, said, faulty, monkeypatch):
    """Before, both were "episode 0 (task '7=') failed: no trace" (a ValueError: exit 2), the reward and its exception
    lost. Now a ``RewardError`` (``amir`` exits 1, as for the run's own rewards) names the reward, its file and line,
    and the taskset; the exception is its cause, its traceback the reward's own."""
    from amir_lightning.helpers.console import user_traceback
    from amir_lightning.rewards.base import RewardError

    monkeypatch.chdir(Path(__file__).parents[1])  # files are named from where amir runs
    with pytest.raises(RewardError) as info:
        faulty(fault)()
    assert str(info.value) == f"reward parsed_digit of the verifiers taskset 'vf_faults' {said}"
    if fault == "raises":
        shown = user_traceback(info.value.__cause__)
        assert isinstance(info.value.__cause__, ValueError) and shown.startswith("Traceback")
        assert 'vf_faults/__init__.py", line 27, in parsed_digit' in shown and "amir_lightning" not in shown
    else:
        assert info.value.__cause__ is None


@pytest.mark.parametrize("fault", ["hangs", "awaits"])  # a blocking call holds verifiers' event loop; an await not
def test_a_taskset_reward_that_hangs_is_named_while_it_runs_and_a_sigterm_ends_the_wait(fault, faulty, caplog):
    """Before, the wait for the episodes said nothing and outlived the stop until the reward returned (20 s here;
    ``amir fit`` was still running 60 s after its SIGTERM). Now the reward still running is named every
    ``reward_warn_s`` (0.3 s), and a stop asked for (what ``amir``'s SIGTERM handler does under Lightning's) ends the
    wait in Lightning's ``SIGTERMException`` (``amir`` exits 143)."""
    import threading
    import time

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from amir_lightning.helpers import stops

    caplog.set_level("WARNING")
    episodes = faulty(fault, reward_warn_s=0.3)
    asked: list[float] = []

    def sigterm() -> None:
        asked.append(time.monotonic())
        stops.request_stop("SIGTERM")

    restore = stops.catch_stop_signals(SIGTERMException)
    stop = threading.Timer(1.5, sigterm)
    try:
        stop.start()
        with pytest.raises(SIGTERMException):
            episodes()
        waited = time.monotonic() - asked[0]
    finally:
        stop.cancel()
        restore()
    beats = [r.getMessage() for r in caplog.records if "has been running for" in r.getMessage()]
    print(f"{fault}: {len(beats)} lines naming the reward; the wait ended {waited:.2f} s after the stop")
    assert beats and all(b.startswith("reward parsed_digit of the verifiers taskset 'vf_faults' has been running for")
                         and b.endswith("data.environment.init_args.reward_warn_s)") for b in beats), beats  # fmt: skip
    assert waited < 3.0  # the loop held by a blocking call is given 2 s to end the episodes, then left


def test_a_taskset_reward_cut_by_the_scoring_deadline_is_named_not_scored_0(faulty):
    """verifiers' own deadline (``agent.timeout.scoring``, 0.5 s) cancels a reward still awaiting: before, the episode
    ended with no score recorded and trained as reward 0; now its reward is named."""
    from amir_lightning.rewards.base import RewardError

    with pytest.raises(RewardError, match=r"^reward parsed_digit of the verifiers taskset 'vf_faults' ran longer than "
                                          r"verifiers' scoring deadline \(agent.timeout.scoring"):  # fmt: skip
        faulty("awaits", agent={"timeout": {"scoring": 0.5}})()


@pytest.mark.slow  # a whole run: about 6 s each
@pytest.mark.parametrize("fault", ["raises", "returns_none"])
def test_amir_fit_on_a_taskset_whose_reward_fails_exits_1_naming_it(fault, tmp_path, monkeypatch, capsys):
    """``amir fit`` (configs/tiny.yaml, HF engine) on ``vf_faults``: before, exit 2 and "episode 0 (task '7=') failed:
    no trace"; now exit 1, the reward's traceback (for an exception), then one line naming it."""
    from conftest import HF_ENGINE, amir_here

    environment = {"taskset": {"id": "vf_faults", "task": {"fault": fault}}}
    tasks = f"{{class_path: amir_lightning.data.VerifiersTasks, init_args: {{environment: {environment}}}}}"
    args = ["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), *HF_ENGINE]
    args += ["--data.prompts", tasks, "--data.rewards", "[EnvironmentReward]", "--trainer.max_epochs", "1"]
    args += ["--data.environment", f"{{class_path: VerifiersEnvironment, init_args: {{environment: {environment}}}}}"]
    code, _, err = amir_here(args, tmp_path, monkeypatch, capsys)
    assert code == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("amir: error: reward parsed_digit of the verifiers taskset 'vf_faults' ("), line
    if fault == "raises":
        assert "raised ValueError: invalid literal for int()" in line
        shown = err.split("amir: error:")[0]  # the reward's traceback, none of ours
        assert 'vf_faults/__init__.py", line 27, in parsed_digit' in shown and "amir_lightning" not in shown
    else:
        assert "returned None: expected a number" in line and "Traceback" not in err


@pytest.mark.slow  # a run in a process of its own, stopped by SIGTERM
@pytest.mark.parametrize("fault", ["hangs", "awaits"])
def test_amir_fit_on_a_taskset_whose_reward_hangs_names_it_and_exits_143_at_sigterm(fault, tmp_path):
    """``amir fit`` (configs/tiny.yaml, HF engine) on ``vf_faults`` whose reward hangs an hour: before, no line after
    the run's start and still running 60 s after SIGTERM; now the reward is named every ``reward_warn_s`` (1 s) and
    SIGTERM ends the run in exit 143 with its one line."""
    import signal
    import sys
    import time

    from conftest import HF_ENGINE
    from helpers.processes import Watched

    path = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, AMIR_CACHE=str(tmp_path / "cache"), PYTHONPATH=path)
    environment = {"taskset": {"id": "vf_faults", "task": {"fault": fault}}}
    tasks = f"{{class_path: amir_lightning.data.VerifiersTasks, init_args: {{environment: {environment}}}}}"
    args = ["fit", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.yaml"), *HF_ENGINE]
    args += ["--data.prompts", tasks, "--data.rewards", "[EnvironmentReward]", "--trainer.max_epochs", "1"]
    args += ["--data.environment", "{class_path: VerifiersEnvironment, init_args: "
             f"{{environment: {environment}, reward_warn_s: 1}}}}"]  # fmt: skip
    run = Watched([sys.executable, "-m", "amir_lightning", *args], tmp_path, env)
    try:
        run.wait_for("reward parsed_digit of the verifiers taskset 'vf_faults' has been running for 1 s", timeout=120)
        sent = time.monotonic()
        run.process.send_signal(signal.SIGTERM)
        code, ended = run.end(timeout=60)
    finally:
        if run.process.poll() is None:
            run.process.kill()
    said = [line for _, line in run.lines if line.startswith("amir: ")]
    print(f"{fault}: exit {code} {ended - sent:.1f} s after SIGTERM; {said}")
    assert code == 143 and said == ["amir: stopped by SIGTERM with 0 of 1 rollouts done; no checkpoint was written yet"]


def test_a_chat_template_that_never_shows_the_tasksets_tools_is_refused_at_start(smollm2, monkeypatch):
    """SmolLM2's own ChatML template ignores ``tools``: the prompt reads the same with and without ``vf_sums``' ``add``,
    so the policy would be trained never having seen its schema. Before: ``prepare`` took it, nothing said. A template
    that shows them starts, and so does SmolLM2's for a taskset without tools (``vf_digits``)."""
    monkeypatch.syspath_prepend(HELPERS)
    env = VerifiersEnvironment("vf_sums")
    with pytest.raises(ValueError) as info:
        env.prepare(smollm2, ChatFormat(tools=env.tool_schemas()))
    assert str(info.value) == (
        f"data.environment.init_args.environment: the chat template of {smollm2.name_or_path} renders the prompt the "
        "same with and without the tools of the verifiers taskset 'vf_sums', so the policy would never see their "
        "schemas: give one that shows them in data.chat_template (configs/templates/chatml_tools.jinja does, in ChatML)"
    )
    with pytest.raises(ValueError, match="^data.environment.init_args.environment: data.chat_template renders the"):
        env.prepare(smollm2, ChatFormat(template=smollm2.chat_template, tools=env.tool_schemas()))
    env.prepare(smollm2, ChatFormat(template=TEMPLATE, tools=env.tool_schemas()))
    VerifiersEnvironment("vf_digits").prepare(smollm2, ChatFormat())


@pytest.mark.slow  # verifiers serves the taskset's tool server from a process of its own
def test_a_huge_result_is_kept_only_as_far_as_the_policy_reads_it(results):
    """4 episodes call ``dump``, whose 8 MiB result verifiers' harness brings back whole; the policy reads 64 tokens
    of it. Before: each episode kept the whole result in its calls and messages (4 x 8,388,600 characters held after
    the rollout); now each keeps the prefix its tokens are read from, and those tokens are the whole result's."""
    from helpers.tool_functions import dump
    from test_tools import shown

    from amir_lightning.environments.replies import encode_reply

    env, chat, tasks = results
    generate, _ = scripted([call("dump", '{"megabytes": 8}'), "Done."])
    (group,) = env.episodes(
        EpisodeBatch([tasks[0]], [chat.render(TOKENIZER, tasks[0])], 4, SAMPLING, Scripted(generate), None, TOKENIZER)
    )
    expected, cut = encode_reply(TOKENIZER, dump(8), 64)
    assert cut and len(expected) == 64
    for c in group:
        kept = c.episode.calls[0]["result"]
        assert c.episode.messages[-2] == {"role": "tool", "name": "dump", "content": kept} and len(kept) <= 16 * 66, (
            len(kept)
        )
        assert shown(c) == [TOKENIZER.decode(expected)] and (c.episode.tool_truncated, c.episode.tool_errors) == (1, 0)


def test_a_result_that_is_not_valid_unicode_is_an_error_the_policy_reads_and_counted(results):
    """A tool message holding a lone surrogate, as verifiers' interception server parses a body that escapes one
    (``json.loads``, where its strict parser refuses it). Before: ``UnicodeEncodeError`` (``encode_reply``) stopped
    the run. Now the policy reads an error naming the tool, counted in ``tools/error_frac``, as for ``data.tools``.

    (Through verifiers' MCP tool servers a lone surrogate does not come back: their JSON parser refuses it, and the
    harness's result is ``error: garbled: MCPError: ...``.)"""
    import asyncio
    import json

    from test_tools import shown
    from verifiers.v1.dialects.chat import ChatDialect, message_to_wire

    from amir_lightning.environments.verifiers.policy import Batches

    env, chat, tasks = results
    client, key, prompt = env._client, "unicode", list(tasks[0].messages)

    async def converse() -> Completion:
        run = client.runs[key] = Batches(
            [0], [chat.render(TOKENIZER, tasks[0])], SAMPLING, None, asyncio.get_running_loop()
        )

        async def ask(messages, text):  # verifiers' call for the episode's next turn; the policy writes ``text``
            body = json.loads(json.dumps({"model": f"amir-{key}-0", "messages": messages, "tools": env.tool_schemas()}))
            reply = asyncio.ensure_future(client.get_response(ChatDialect(), body, None))
            while run.requests.empty() and not reply.done():
                await asyncio.sleep(0.01)
            if not reply.done():
                own = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [EOS]
                run.deliver(run.requests.get(), [Completion(own, text, [-0.5] * len(own), "stop")])
            return (await reply).message

        first = await ask(prompt, call("garbled", "{}"))
        result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "ok \ud800 ok"}
        await ask([*prompt, message_to_wire(first), result], "Done.")
        run.finish(0)
        return run.records[0].completion(TOKENIZER)

    try:
        completion = asyncio.run(converse())
    finally:
        client.runs.pop(key, None)
    why = "error: the result of garbled is not valid Unicode (surrogates not allowed at character 3)"
    assert completion.episode.calls[0]["result"] == why and shown(completion) == [why[:64]]  # one token a character
    assert (completion.episode.tool_calls, completion.episode.tool_errors) == (1, 1)
    assert tool_metrics([completion])["tools/error_frac"] == 1.0
