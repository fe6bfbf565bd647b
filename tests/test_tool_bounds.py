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
