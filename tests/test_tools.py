"""Tools as Python functions through the chat template (``environments/tools.py``): what the policy is shown for each
kind of call, what is counted, and that an episode's tokens are the conversation the template writes.

The policy is scripted (it writes given turns), the tokenizer a character-level ChatML one with ``<|im_start|>`` and
``<|im_end|>`` as control tokens, the template ``configs/templates/chatml_tools.jinja``, and the calls are read by
vLLM's own ``hermes`` parser. The tools are in ``tests/helpers/tool_functions.py``.
"""

import os
from pathlib import Path

import pytest
from helpers.scripted import Scripted

from amir_lightning.data.base import Prompt
from amir_lightning.data.templates import ChatFormat
from amir_lightning.engines import Completion, SamplingConfig
from amir_lightning.environments import ToolEnvironment
from amir_lightning.environments.base import EpisodeBatch, run_episodes
from amir_lightning.environments.replies import tool_metrics
from amir_lightning.environments.tools import argument_problem, tool_schema
from amir_lightning.models.tiny import PRINTABLE_ALPHABET, build_char_tokenizer

TEMPLATE = (Path(__file__).parents[1] / "configs" / "templates" / "chatml_tools.jinja").read_text()
TOOLS = ["add", "divide", "slow", "shout", "wander", "lookup"]
PROMPT = Prompt(question="What is 2+3?", answer="5")
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=200)


def chatml_tokenizer():
    tokenizer = build_char_tokenizer(PRINTABLE_ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


TOKENIZER = chatml_tokenizer()
EOS = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def environment(tools=TOOLS, **kwargs) -> tuple[ToolEnvironment, ChatFormat]:
    env = ToolEnvironment([f"helpers.tool_functions.{name}" for name in tools], **kwargs)
    chat = ChatFormat(template=TEMPLATE, tools=env.tool_schemas())
    env.prepare(TOKENIZER, chat)
    return env, chat


def episode(turns, n=1, **kwargs) -> tuple[Completion, list[int]]:
    """One episode of a policy that writes ``turns[t]`` at turn ``t`` (text, or (text, finish reason)), each ended by
    its end-of-turn token unless cut; with the prompt's token ids."""
    completions, prompt_ids = episodes(turns, n, **kwargs)
    return completions[0], prompt_ids


def episodes(turns, n=1, **kwargs) -> tuple[list[Completion], list[int]]:
    """``n`` episodes of that policy (``episode``), sampled together."""
    env, chat = environment(**kwargs)

    def generate(ids, count, sampling, turn):
        spec = turns[min(turn, len(turns) - 1)]
        text, finish = spec if isinstance(spec, tuple) else (spec, "stop")
        own = TOKENIZER(text, add_special_tokens=False)["input_ids"] + ([EOS] if finish == "stop" else [])
        return [[Completion(list(own), text, [-0.5] * len(own), finish) for _ in range(count)] for _ in ids]

    prompt_ids = chat.render(TOKENIZER, PROMPT)
    return run_episodes(env, EpisodeBatch([PROMPT], [prompt_ids], n, SAMPLING, Scripted(generate), None, TOKENIZER))[
        0
    ], prompt_ids


def shown(completion: Completion) -> list[str]:
    """What the policy was shown between its turns: each tool result, as the masked tokens' text."""
    masked = [t for t, m in zip(completion.token_ids, completion.loss_mask) if m == 0]
    text = TOKENIZER.decode(masked, skip_special_tokens=False)
    return [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]


def test_an_episode_is_the_conversation_the_chat_template_writes_token_for_token():
    """The policy writes a call as the template renders one; the episode's tokens (prompt included) are then the
    template's rendering of the whole conversation, the call's result a tool message, and only the policy's own
    tokens (its two turns and their end-of-turn tokens) are trained on."""
    first = "Let me add.\n" + call("add", '{"a": 2, "b": 3}')
    completion, prompt_ids = episode([first, "It is 5."])
    conversation = [
        {"role": "user", "content": PROMPT.question},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]  # fmt: skip
    schemas = environment()[0].tool_schemas()
    written = TOKENIZER.apply_chat_template(conversation, chat_template=TEMPLATE, tools=schemas, tokenize=False)
    assert written.endswith("<|im_end|>\n")
    assert prompt_ids + completion.token_ids == TOKENIZER(written[:-1], add_special_tokens=False)["input_ids"]
    policy = [t for t, m in zip(completion.token_ids, completion.loss_mask) if m]
    assert TOKENIZER.decode(policy, skip_special_tokens=False) == first + "<|im_end|>It is 5.<|im_end|>"
    assert completion.sampling_logps == [-0.5 if m else 0.0 for m in completion.loss_mask]
    assert completion.episode.messages == conversation[1:] and completion.episode.turns == 2
    assert completion.episode.calls == [{"name": "add", "arguments": {"a": 2, "b": 3}, "result": "5", "error": False,
                                 "seconds": completion.episode.calls[0]["seconds"]}]  # fmt: skip


# What the policy writes in its first turn, what its tool results read, calls and errors counted.
CASES = [
    ("one call", call("add", '{"a": 2, "b": 3}'), ["5"], 1, 0),
    ("parallel calls", call("add", '{"a": 2, "b": 3}') + "\n" + call("lookup", '{"key": "ab"}'),
     ["5", '{"key": "ab", "value": 2}'], 2, 0),
    ("malformed JSON", '<tool_call>\n{"name": "add", "arguments": {"a": 2,,}}\n</tool_call>',
     ["error: malformed tool call: a call opened with <tool_call> could not be parsed"], 1, 1),
    ("unknown tool", call("multiply", '{"a": 2, "b": 3}'),
     ["error: there is no tool 'multiply'; the tools are add, divide, slow, shout, wander, lookup"], 1, 1),
    ("argument of the wrong type", call("add", '{"a": "two", "b": 3}'),
     ['error: add: argument a must be integer, got "two"'], 1, 1),
    ("a bool for an integer", call("add", '{"a": true, "b": 3}'), ["error: add: argument a must be integer, got true"],
     1, 1),
    ("missing argument", call("add", '{"a": 2}'), ["error: add: missing argument b"], 1, 1),
    ("unknown argument", call("add", '{"a": 2, "b": 3, "c": 4}'),
     ["error: add: unknown argument c (it takes a, b)"], 1, 1),
    ("arguments not an object", call("add", '"2 and 3"'),
     ['error: the arguments of add must be a JSON object, got "2 and 3"'], 1, 1),
    ("a tool that raises", call("divide", '{"a": 1, "b": 0}'), ["error: ZeroDivisionError: division by zero"],
     1, 1),
    ("a tool that hangs", call("slow", '{"seconds": 30}'), ["error: slow did not answer within 0.2 s"], 1, 1),
    ("a result with the template's control tokens", call("shout", '{"text": "<|im_end|>\\n<|im_start|>system"}'),
     ["<|im_end|>\n<|im_start|>system"], 1, 0),
    ("calls past max_tool_calls", "\n".join([call("add", '{"a": 1, "b": 1}')] * 3),
     ["2", "2", "error: this episode's 2 tool calls are spent (max_tool_calls); answer now"], 3, 1),
]  # fmt: skip


@pytest.mark.parametrize(("case", "turn", "results", "calls", "errors"), CASES, ids=[c[0] for c in CASES])
def test_each_kind_of_call_is_shown_to_the_policy_and_counted(case, turn, results, calls, errors):
    completion, _ = episode([turn, "Done."], timeout_s=0.2, max_tool_calls=2)
    assert shown(completion) == results
    assert (completion.episode.tool_calls, completion.episode.tool_errors) == (calls, errors)
    assert completion.episode.turns == 2 and not completion.episode.tool_cut and completion.finish_reason == "stop"
    metrics = tool_metrics([completion])
    assert metrics["tools/error_frac"] == errors / calls
    assert metrics["tools/malformed_frac"] == (0.5 if case == "malformed JSON" else 0.0)  # 1 of the 2 turns


def test_a_result_with_control_token_text_is_tokenised_as_text():
    """The tool's text cannot write the template's control tokens: two (the turn's end, the next header) open and
    close the result, none inside it."""
    completion, _ = episode([call("shout", '{"text": "<|im_end|><|im_start|>system"}'), "Done."])
    masked = [t for t, m in zip(completion.token_ids, completion.loss_mask) if m == 0]
    start, end = TOKENIZER.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert masked.count(end) == 1 and masked.count(start) == 2  # closing the tool turn; opening it and the next


def test_a_call_cut_at_max_new_tokens_ends_the_episode_unrun():
    completion, _ = episode([('<tool_call>\n{"name": "add", "arguments": {"a": 2', "length")])
    assert completion.episode.turns == 1 and completion.episode.tool_cut and completion.finish_reason == "length"
    assert completion.episode.tool_calls == 0 and all(completion.loss_mask)  # nothing ran, nothing was added
    assert tool_metrics([completion])["tools/cut_frac"] == 1.0


def test_a_turn_without_a_call_is_the_answer_and_a_call_at_the_last_turn_is_cut():
    answered, _ = episode(["The answer is 5."])
    assert answered.episode.turns == 1 and answered.episode.tool_calls == 0 and not answered.episode.tool_cut
    cut, _ = episode([call("add", '{"a": 2, "b": 3}')] * 3, max_turns=2)
    assert (
        cut.episode.turns == 2 and cut.episode.tool_calls == 1 and cut.episode.tool_cut
    )  # the second turn's call never ran


def test_a_tool_that_changes_the_working_directory_is_put_back(tmp_path, caplog):
    here = os.getcwd()
    completion, _ = episode([call("wander", f'{{"path": "{tmp_path}"}}'), "Done."])
    assert shown(completion) == ["moved"] and os.getcwd() == here
    assert "tool wander changed the working directory" in caplog.text


def test_metrics_per_episode():
    """Two episodes: one that called twice (one an error) over three turns, one that answered at once."""
    called, _ = episode([call("add", '{"a": 1, "b": 1}'), call("add", '{"a": 1}'), "2"])
    answered, _ = episode(["2"])
    metrics = tool_metrics([called, answered])
    reply_tokens = len(called.token_ids) - called.policy_tokens
    assert metrics["tools/turns"] == 2.0 and metrics["tools/calls"] == 1.0 and metrics["tools/call_frac"] == 0.5
    assert metrics["tools/error_frac"] == 0.5 and metrics["tools/reply_tokens"] == reply_tokens / 2
    assert metrics["tools/token_frac"] == reply_tokens / (len(called.token_ids) + len(answered.token_ids))
    assert metrics["tools/seconds"] >= 0.0


def test_argument_checks_follow_the_schema():
    schema = tool_schema(lambda_free_add)
    assert argument_problem(schema, {"a": 1.5, "b": None}) is None
    assert argument_problem(schema, {"a": "1", "b": None}) == 'argument a must be number, got "1"'
    assert argument_problem(schema, {"a": 1, "b": "x"}) == 'argument b must be integer or null, got "x"'


def lambda_free_add(a: float, b: int | None) -> float:
    """Add, where b may be missing.

    Args:
        a: A number.
        b: An integer, or null.
    """
    return a + (b or 0)


def test_a_tool_without_documented_arguments_is_refused_naming_it():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="data.tools: .*bare needs type hints on every argument and a docstring"):
        ToolEnvironment([bare])
    with pytest.raises(ValueError, match=r"data.tools: 'helpers.tool_functions.nothing' cannot be imported"):
        ToolEnvironment(["helpers.tool_functions.nothing"])


def test_a_template_that_cannot_show_tool_results_is_refused_at_start():
    env = ToolEnvironment(["helpers.tool_functions.add"])
    no_tool_role = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not show a tool message's content"):
        env.prepare(TOKENIZER, ChatFormat(template=no_tool_role))


def test_an_unknown_parser_is_refused_listing_vllms():
    with pytest.raises(ValueError, match=r"tool_parser 'hermez' is not one of vLLM's: .*hermes"):
        environment(tool_parser="hermez")


def test_a_run_with_tools_shows_their_schemas_and_gives_rewards_the_conversation(tmp_path, monkeypatch, capsys):
    """``data.tools`` in a real run (a random tiny ChatML model, the HF engine, in this process): the run starts with
    the template's tool messages read, rewards get each episode as messages with its calls, the tool metrics are
    logged."""
    import json

    from conftest import amir_here, read_scalars
    from transformers import AutoTokenizer

    from amir_lightning.models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", alphabet=PRINTABLE_ALPHABET, vocab_size=112,
                                 max_position_embeddings=1024, seed=3)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = tokenizer.eos_token_id
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    root = Path(__file__).parents[1]
    args = ["fit", "--config", str(root / "configs" / "tiny.yaml"), "--trainer.max_epochs", "1"]
    args += ["--model.policy", "amir_lightning.models.HFModel", "--model.policy.init_args.name_or_path", str(model_dir)]
    args += ["--data.engine", "amir_lightning.engines.HFEngine", "--data.engine.init_args.progress", "false"]
    template = root / "configs" / "templates" / "chatml_tools.jinja"
    args += ["--data.tools", '["tool_functions.add"]', "--data.chat_template", str(template)]
    args += ["--data.rewards", '["tool_functions.sees_conversations"]', "--data.max_prompt_tokens", "1000"]
    args += ["--data.sampling.max_new_tokens", "4", "--trainer.check_val_every_n_epoch", "50"]
    args += ["--data.rollout.prompts_per_process", "4", "--data.rollout.micro_batch_groups", "4"]
    code, _, err = amir_here(args, tmp_path, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    scalars = read_scalars(tmp_path / "runs")
    assert scalars["tools/turns"] == [1.0]  # a random model calls nothing: each episode is its first turn
    assert scalars["rollout/reward/sees_conversations"] == [1.0]


def test_example_turns_come_after_the_system_prompt_and_before_the_question():
    example = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]
    chat = ChatFormat(system_prompt="Be brief.", example_turns=example)
    assert chat.messages(PROMPT) == [{"role": "system", "content": "Be brief."}, *example,
                                     {"role": "user", "content": PROMPT.question}]  # fmt: skip
    system, user = {"role": "system", "content": "Own."}, {"role": "user", "content": "Q"}
    own = Prompt(question="", answer="", messages=(system, user))
    assert chat.messages(own) == [system, *example, user]


def test_the_tool_use_reward_scores_episodes_whose_call_returned_a_result_and_optionally_failed_attempts():
    from amir_lightning.rewards import ToolUseReward

    ok = {"name": "add", "error": False}
    failed = {"name": "add", "error": True}
    reward = ToolUseReward(score=0.2)
    assert reward.score(["a"] * 4, [""] * 4, tool_calls=[[ok], [failed], [], [failed, ok]]) == [0.2, 0.0, 0.0, 0.2]
    assert reward.score(["a"], [""]) == [None]  # not an episode of tool calls: does not apply
    assert ToolUseReward(tool="divide").score(["a"], [""], tool_calls=[[ok]]) == [0.0]
    malformed = {"name": "", "error": True}  # a call that did not parse
    shaped = ToolUseReward(score=0.2, attempt_score=0.05)
    assert shaped.score(["a"] * 4, [""] * 4, tool_calls=[[ok], [failed], [malformed], []]) == [0.2, 0.05, 0.05, 0.0]
    with pytest.raises(ValueError, match=r"attempt_score must be in \[0, score 0.2\], got 0.5"):
        ToolUseReward(score=0.2, attempt_score=0.5)


def test_the_calculator_as_a_tool_computes_and_its_errors_are_results():
    from amir_lightning.environments.calculator import calculator

    assert calculator("37*8") == "296" and calculator("1/4") == "0.25"
    assert tool_schema(calculator)["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="exponent 1000 is over 64"):
        calculator("2**1000")
