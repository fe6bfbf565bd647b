"""The tools of ``vf_results``, an MCP server verifiers starts as ``python -m vf_results.tools``."""

import verifiers.v1 as vf


class Results(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tools are shown as ``garbled`` and ``dump``

    @vf.tool
    async def garbled(self) -> str:
        """Text holding a lone surrogate."""
        return "ok \ud800 ok"

    @vf.tool
    async def dump(self, megabytes: int) -> str:
        """Words, as many megabytes of them as asked."""
        return "the quick brown fox jumps over the lazy dog " * (megabytes * 2**20 // 44)


if __name__ == "__main__":
    Results.run()
