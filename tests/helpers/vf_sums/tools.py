"""The ``add`` tool of ``vf_sums``, an MCP server verifiers starts as ``python -m vf_sums.tools``."""

import verifiers.v1 as vf


class Adder(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is shown as ``add``

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    Adder.run()
