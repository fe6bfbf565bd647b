"""The harness ``VerifiersEnvironment`` runs every episode with (verifiers 0.4's ``Harness`` seam).

A chat loop in the training process: it sends the task's messages and the taskset's tools (its MCP tool servers) to
the model through verifiers' interception endpoint, runs each tool call the reply makes on its server, appends the
results as ``tool`` messages and asks again, until a reply calls no tool or verifiers' limits (``max_turns``) end
the episode. verifiers records every call into the episode's trace and scores it with the task's rewards.

Loaded by id (``amir_lightning.environments.verifiers.harness``), as verifiers loads harnesses: a module that
exports its one ``Harness`` subclass.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

__all__ = ["ChatHarness"]


class ChatHarnessConfig(vf.HarnessConfig):
    """No settings of its own: verifiers' agent config bounds the episode (``max_turns``, timeouts)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """A chat loop with the taskset's tools, in this process (no program, container or network of its own)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(  # noqa: D102 - verifiers' seam: one episode
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                tools, dispatch, servers = [], {}, {}
                if mcp_urls:
                    spec = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
                    tools, dispatch, servers = await connect_mcp(spec, stack)
                while True:  # verifiers refuses the call past max_turns, which ends the loop
                    reply = await client.chat.completions.create(
                        model=ctx.model, messages=messages, tools=tools or None
                    )
                    message = reply.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": await _run(call, dispatch, servers)}
                        )
        except Exception as err:  # noqa: BLE001 - a refused call (a limit, a stop) ends the episode; verifiers says why
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(err).__name__}: {err}")
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _run(call, dispatch, servers) -> str:
    """One tool call's result as the model reads it; a call that cannot run is an ``error: ...`` result."""
    name = call.function.name
    if name not in dispatch:
        return f"error: there is no tool {name!r}; the tools are {', '.join(dispatch) or 'none'}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return f"error: the arguments of {name} must be a JSON object, got {call.function.arguments[:80]}"
    try:
        result = await call_mcp(servers, dispatch, name, arguments)
    except Exception as err:  # noqa: BLE001 - the tool's error is the model's to read
        return f"error: {name}: {type(err).__name__}: {err}"
    return result if isinstance(result, str) else json.dumps(result)
