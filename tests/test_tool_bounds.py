"""Tools as Python functions under faults of their own (``environments/tools.py``): a signature no call can reach, a
chat template that never shows the tools, results that are huge or not text, and tools that hang.

Each is refused at start in one line naming ``data.tools``, or is an outcome of the episode the policy reads and the
rollout counts; a wait on a tool has one deadline per turn, a line naming the tool, and ends at a stop. The scripted
policy, the ChatML tokenizer and the template are those of ``tests/test_tools.py``; the tools are in
``tests/helpers/tool_functions.py``.
"""

import threading
import time

import pytest

from amir_lightning.environments import ToolEnvironment

TOOLS = "helpers.tool_functions"


@pytest.mark.parametrize(
    ("tool", "why"),
    [("total", "takes *values"), ("first", "takes a by position only"), ("options", "takes **extra")],
)
def test_a_tool_whose_signature_no_call_by_name_can_reach_is_refused_naming_it(tool, why):
    """A call passes the JSON object the policy writes as keyword arguments: ``total(values=3)`` raises, and so would
    every call. Before: accepted, then every call was an error."""
    with pytest.raises(ValueError) as info:
        ToolEnvironment([f"{TOOLS}.{tool}"])
    assert str(info.value) == (
        f"data.tools: {tool} {why}: a call passes each argument by name (the JSON object the policy writes), so it "
        "could never be called as its schema says; give every argument a name"
    )


def test_a_chat_template_that_never_shows_the_tools_is_refused_at_start(smollm2):
    """SmolLM2's own ChatML template ignores ``tools``: the prompt reads the same with and without them, so the policy
    would be trained never having seen a schema. Before: the run trained, nothing said. A template that shows them
    (``configs/templates/chatml_tools.jinja``) starts."""
    from test_tools import TEMPLATE

    from amir_lightning.data.templates import ChatFormat

    env = ToolEnvironment([f"{TOOLS}.add"])
    with pytest.raises(ValueError) as info:
        env.prepare(smollm2, ChatFormat(tools=env.tool_schemas()))
    assert str(info.value) == (
        f"data.tools: the chat template of {smollm2.name_or_path} renders the prompt the same with and without the "
        "tools, so the policy would never see their schemas: give one that shows them in data.chat_template "
        "(configs/templates/chatml_tools.jinja does, in ChatML)"
    )
    with pytest.raises(ValueError, match="^data.tools: data.chat_template renders the prompt the same with and"):
        env.prepare(smollm2, ChatFormat(template=smollm2.chat_template, tools=env.tool_schemas()))
    env.prepare(smollm2, ChatFormat(template=TEMPLATE, tools=env.tool_schemas()))


def test_a_result_that_is_not_valid_unicode_is_an_error_the_policy_reads_and_counted():
    """A lone surrogate (``"\\ud800"``) cannot be tokenised. Before: the tokenizer's traceback stopped the run."""
    from test_tools import call, episode, shown

    from amir_lightning.environments.replies import tool_metrics

    completion, _ = episode([call("garbled", "{}"), "Done."], tools=["garbled"])
    assert shown(completion) == ["error: the result of garbled is not valid Unicode (surrogates not allowed at "
                                 "character 3)"]  # fmt: skip
    assert (completion.episode.tool_calls, completion.episode.tool_errors) == (1, 1)
    assert tool_metrics([completion])["tools/error_frac"] == 1.0


def test_a_huge_result_is_kept_only_as_far_as_the_policy_reads_it():
    """8 episodes each get an 8 MiB result, cut to 64 tokens. Before: each kept the whole result in its messages and
    calls (8 x 8,388,600 characters held after the rollout); now each keeps the prefix its tokens are read from,
    and those tokens are the ones the whole result gives."""
    from helpers.tool_functions import dump
    from test_tools import TOKENIZER, call, episodes, shown

    from amir_lightning.environments.replies import encode_reply

    completions, _ = episodes([call("dump", '{"megabytes": 8}'), "Done."], n=8, tools=["dump"], max_reply_tokens=64)
    expected, cut = encode_reply(TOKENIZER, dump(8), 64)
    assert cut and len(expected) == 64
    for completion in completions:
        kept = completion.episode.calls[0]["result"]
        assert completion.episode.messages[1]["content"] == kept and len(kept) <= 16 * 66, len(kept)
        assert shown(completion) == [TOKENIZER.decode(expected)] and completion.episode.tool_truncated == 1


TEXTS = {
    "words": "the quick brown fox jumps over the lazy dog " * 50_000,
    "one long word": "a" * 2_000_000,
    "a rule of =": "=" * 2_000_000,
    "CJK": "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002" * 200_000,
    "JSON": '{"key": [1, 2.5, "x"], "nested": {"a": null}}, ' * 40_000,
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_the_kept_prefix_of_a_result_gives_the_tokens_of_the_whole_result(text, smollm2):
    """SmolLM2's byte-level BPE: a result cut first by characters (on the tool's thread), then to the prefix the
    tokens are read from, gives the first ``max_reply_tokens`` tokens of the whole result, and says it was cut."""
    from amir_lightning.environments.replies import encode_reply, kept_reply, reply_char_bound

    limit = 256
    kept = kept_reply(smollm2, text[: reply_char_bound(smollm2, limit)], limit)
    assert encode_reply(smollm2, kept, limit) == encode_reply(smollm2, text, limit)
    assert len(kept) < 20_000, len(kept)  # of 2 MB or more


def test_a_turns_calls_run_together_under_one_deadline_and_a_line_names_the_tool(caplog):
    """16 episodes call a tool that hangs in the same turn, ``timeout_s`` 0.5. Before: the calls ran one after
    another, each waiting its whole timeout (8 s for the turn, nothing logged); now together, under one deadline,
    and one warning names the tool."""
    from test_tools import call, environment, episodes, shown

    environment(tools=["slow"])  # vLLM's parser imported before the clock starts
    start = time.monotonic()
    completions, _ = episodes([call("slow", '{"seconds": 30}'), "Done."], n=16, tools=["slow"], timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    assert all(
        shown(c) == ["error: slow did not answer within 0.5 s"] and c.episode.tool_errors == 1 for c in completions
    )
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "did not answer" in r.getMessage()]
    assert said == ["data.tools: tool slow did not answer within 0.5 s (timeout_s) in 16 of 16 calls; the policy "
                    "reads an error, and their threads are left to finish"]  # fmt: skip


def test_a_stop_ends_the_wait_on_a_tool_at_once():
    """SIGTERM (as Lightning's handler passes it on: a stop recorded, nothing raised) while 4 episodes wait on a tool
    that hangs, ``timeout_s`` 5: the wait ends within a second in what the run makes of SIGTERM (exit 143). Before:
    it waited 4 x 5 s, then went on with the rollout."""
    from test_tools import call, environment, episodes

    from amir_lightning.helpers import stops

    environment(tools=["slow"])
    restore = stops.catch_stop_signals()
    timer = threading.Timer(0.3, stops.request_stop, ["SIGTERM"])
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(SystemExit) as info:
            episodes([call("slow", '{"seconds": 60}'), "Done."], n=4, tools=["slow"], timeout_s=5)
        assert info.value.code == 143 and time.monotonic() - start < 1.5
    finally:
        timer.cancel()
        restore()
