"""Tools as Python functions under faults of their own (``rollout/tools.py``): a signature no call can reach, a chat
template that never shows the tools, results that are huge or not text, and tools that hang.

Each is refused at start in one line naming ``data.tools``, or is an outcome of the episode the policy reads and the
rollout counts; a wait on a tool has one deadline per turn, a line naming the tool, and ends at a stop. The scripted
policy, the ChatML tokenizer and the template are those of ``tests/test_tools.py``; the tools are in
``tests/helpers/tool_functions.py``.
"""

import pytest

from amir_lightning.rollout import ToolEnvironment

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


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from amir_lightning.models import BundledSmolLM2

    return AutoTokenizer.from_pretrained(BundledSmolLM2().resolve())


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
