"""Environments from verifiers (0.4: ``pip install 'amir-lightning[verifiers]'``), scored by their own rewards.

A taskset written for prime-rl trains here unchanged. verifiers runs an episode as a harness talking to the model
through an interception server that records every call into the episode's trace, with the taskset's tools as MCP
servers, then scores the trace with the task's ``@vf.reward`` functions. Here:

- the harness is ``rollout/verifiers_harness.py``: a chat loop in this process, the tool calls going to the
  taskset's tool servers and their results coming back as ``tool`` messages;
- the interception server's client is the policy (``PolicyClient``, ``rollout/verifiers_policy.py``): each call
  is sampled by the run's engine, together with the calls of every other episode then waiting (one batch per turn,
  seeded by its place in the run), and its tool calls are read by the policy's own parser (``tool_parser``);
- an episode's tokens are the prompt's as the run rendered it, the policy's turns (trained on) and the chat
  template's text with the tool results between them (masked, ``ToolReplies``), so the trainer scores exactly what
  the engine sampled, and verifiers' trace holds one branch;
- the trace's reward, its named rewards and metrics go with the completion (``Completion.outcome``) to
  ``EnvironmentReward``.

Harnesses that run a program of their own (codex, claude code, ...) are for an agent's sandbox, not a training
loop: they are refused at start. A taskset's tool servers shared by the run start once; those of each task
(``Task.toolsets``) start with every episode, as in verifiers (a process each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.verifiers_tasks import import_verifiers, load_tasks, task_messages, taskset_config
from amir_lightning.rollout.engine import Completion, SamplingConfig
from amir_lightning.rollout.episodes import Environment, Turn
from amir_lightning.rollout.tool_calls import ToolCallParser
from amir_lightning.rollout.tools import ToolReplies
from amir_lightning.rollout.verifiers_policy import CLIENTS, URL, Batches, Episode, PolicyClient, hook_clients

KEY = "data.environment.init_args"
#: The harness every episode runs with (``rollout/verifiers_harness.py``), by the id verifiers loads it with: it
#: imports a harness id as a top-level module, so the module is registered under this name.
HARNESS = "amir_lightning_harness"
_IDS = itertools.count()


def env_config(environment: str | dict[str, Any], key: str, max_turns: int):
    """The verifiers environment config of ``environment``, its episodes run by this project's harness here.

    Raises:
        ValueError: The config names another harness (one that runs a program of its own), or no taskset.
    """
    import sys

    from amir_lightning.rollout import verifiers_harness

    vf = import_verifiers(key)
    sys.modules.setdefault(HARNESS, verifiers_harness)
    raw = taskset_config(environment, key)
    agent = dict(raw.get("agent") or {})
    harness = dict(agent.get("harness") or {})
    if harness.get("id") not in (None, "null", HARNESS):  # null: verifiers' own chat loop, which ours runs here
        raise ValueError(
            f"{key}: the harness {harness['id']!r} runs a program of its own; episodes here are a chat loop in the "
            "training process (leave agent.harness out)"
        )
    agent.update(harness={"id": HARNESS}, runtime={"type": "subprocess"}, max_turns=max_turns)
    try:
        return vf.resolve_env_config({**raw, "agent": agent})
    except Exception as err:  # noqa: BLE001 - verifiers says what is wrong; say where
        raise ValueError(f"{key}: {type(err).__name__}: {err}") from None


class VerifiersEnvironment(Environment):
    """A verifiers taskset's episodes, sampled by the policy and scored by the taskset (``rollout/verifiers_env.py``).

    Give ``data.prompts`` a ``VerifiersTasks`` of the same taskset and ``data.rewards`` an ``EnvironmentReward``.

    Args:
        environment: The taskset's id (its importable module), a verifiers environment config as
            ``vf.resolve_env_config`` takes it (``{taskset: {id: ...}}``, its agent's ``timeout`` and limits), or
            in Python an environment ``vf.load_environment`` loaded (its harness must be verifiers' chat loop,
            ``null``, which runs here as ``rollout/verifiers_harness.py``).
        tool_parser: How a turn's tool calls are read: one of vLLM's tool parsers by name (``hermes`` for Qwen2.5 and
            Hermes-format templates), or ``response_template`` (the tokenizer's own).
        max_turns: Policy turns per episode (verifiers' ``agent.max_turns``); an episode still calling tools at the
            last is cut.
        max_reply_tokens: Longest tool result in tokens (a longer one is cut, and counted).
    """

    def __init__(
        self,
        environment: str | dict[str, Any] | Any,
        tool_parser: str = "hermes",
        max_turns: int = 4,
        max_reply_tokens: int = 256,
    ) -> None:
        super().__init__(max_turns=max_turns, max_reply_tokens=max_reply_tokens)
        vf = import_verifiers("data.environment")
        self.config = env_config(environment, f"{KEY}.environment", max_turns)
        self.env = vf.load_environment(self.config)
        self.tasks = load_tasks(self.config.taskset.model_dump(mode="json"), f"{KEY}.environment")
        self.tool_parser = tool_parser
        self.schemas = asyncio.run(_tool_schemas(self.env))
        self._id = str(next(_IDS))
        self._client: PolicyClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self._starting = threading.Lock()  # a rollout sampled ahead and a validation may start it at once
        for name in ("verifiers", "aiohttp.access", "httpx"):  # a line per episode and per call; warnings show
            logging.getLogger(name).setLevel(logging.WARNING)

    @override
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return list(self.schemas) or None

    @override
    def prepare(self, tokenizer, chat) -> None:
        """Read the policy's chat template (the text between two turns) and its tool-call parser, once."""
        parser = ToolCallParser(self.tool_parser, tokenizer, self.schemas) if self.schemas else None
        replies = ToolReplies(tokenizer, chat, self.schemas[0]["function"]["name"], self.max_reply_tokens) if (
            self.schemas
        ) else None  # fmt: skip
        self._client = PolicyClient(tokenizer, chat, parser, replies, {s["function"]["name"] for s in self.schemas})

    @override
    def reset(self, prompt: Prompt) -> None:
        return None  # verifiers keeps each episode's state

    @override
    def episodes(
        self,
        prompts: Sequence[Prompt],
        prompt_ids: Sequence[list[int]],
        n: int,
        sampling: SamplingConfig,
        generate: Turn,
        tokenizer,
        room: int | None = None,
    ) -> list[list[Completion]]:
        """``n`` episodes of each prompt's task, run by verifiers while this thread samples their turns."""
        if self._client is None:
            raise RuntimeError("VerifiersEnvironment.prepare must run before its first episode")
        tasks = [self._task(prompt) for prompt in prompts]  # a stray prompt is refused before anything starts
        loop = self._start()
        run = Batches([i for i in range(len(prompts)) for _ in range(n)], prompt_ids, sampling, room, loop)
        key = str(next(_IDS))  # a rollout sampled ahead and a validation can run at once
        self._client.runs[key] = run
        done = asyncio.run_coroutine_threadsafe(self._run(run, key, tasks, n), loop)
        try:
            for turn in itertools.count():
                batch = run.requests.get()
                if batch is None:
                    break
                sampled = generate([ids for _, ids in batch], 1, sampling, turn)
                loop.call_soon_threadsafe(run.deliver, batch, [group[0] for group in sampled])
            episodes = done.result()
        except BaseException:
            done.cancel()
            raise
        finally:
            del self._client.runs[key]
        out: list[list[Completion]] = [[] for _ in prompts]
        for index, (record, episode) in enumerate(zip(run.records, episodes)):
            out[record.prompt_index].append(_completion(record, episode, tokenizer, tasks[record.prompt_index], index))
        return out

    def _task(self, prompt: Prompt):
        """The task a prompt of ``VerifiersTasks`` stands for (the same taskset, loaded once per process)."""
        index = prompt.meta.get("task") if prompt.meta.get("source") == f"verifiers:{self.config.taskset.id}" else None
        if index is None or not 0 <= index < len(self.tasks):
            raise ValueError(
                f"{KEY}.environment: the prompt {prompt.question!r:.60} is not a task of the verifiers taskset "
                f"{self.config.taskset.id!r}: give data.prompts (and data.val_prompts) VerifiersTasks of the same "
                "environment"
            )
        task = self.tasks[index]
        if tuple(task_messages(task)) != tuple(prompt.messages or ()):
            raise ValueError(f"{KEY}.environment: task {index} of {self.config.taskset.id!r} is not the prompt drawn")
        return task

    async def _run(self, run: Batches, key: str, tasks: list, n: int) -> list:
        vf = import_verifiers("data.environment")
        slots = [slot for task in tasks for slot in self.env.slots(task, n=n)]

        async def one(index: int, slot):
            context = vf.ModelContext(
                model=f"amir-{key}-{index}", client=vf.TrainClientConfig(base_url=URL.format(self._id))
            )
            try:
                return await self.env.run_slot(slot, context)
            finally:
                run.finish(index)

        try:
            return await asyncio.gather(*(one(index, slot) for index, slot in enumerate(slots)))
        finally:
            run.requests.put(None)

    def _start(self) -> asyncio.AbstractEventLoop:
        """The event loop verifiers runs in (a thread of its own), the environment served from it (once)."""
        with self._starting:
            if self._loop is None:
                self._loop = self._serve()
            return self._loop

    def _serve(self) -> asyncio.AbstractEventLoop:
        hook_clients()
        CLIENTS[self._id] = self._client
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="verifiers", daemon=True).start()

        async def serve() -> contextlib.AsyncExitStack:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self.env.serving())  # the interception server, shared tool servers
            return stack

        self._serving = asyncio.run_coroutine_threadsafe(serve(), loop).result()
        return loop

    @override
    def close(self) -> None:
        """Stop serving (the interception server, the tool servers) and the event loop; a later episode starts them."""
        with self._starting:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._serving is not None:
            asyncio.run_coroutine_threadsafe(self._serving.aclose(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        self._serving = None
        CLIENTS.pop(self._id, None)


def _completion(record: Episode, episode, tokenizer, task, index: int) -> Completion:
    """The episode as a completion, with the taskset's scoring of it."""
    if not episode.ok:
        errors = "; ".join(str(getattr(e, "message", e)) for e in episode.errors) or "no trace"
        raise ValueError(f"{KEY}.environment: episode {index} (task {task.data.prompt!r:.60}) failed: {errors}")
    trace = episode.traces[0]
    if record.messages and record.messages[-1].get("tool_calls"):
        record.tool_cut = True  # still calling tools when verifiers' limits ended it
    rewards = {name: r.score for name, r in trace.rewards.items() if r is not None and r.score is not None}
    metrics = {name: float(v) for name, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
    outcome = {"reward": None if trace.reward is None else float(trace.reward), "rewards": rewards, "metrics": metrics}
    return replace(record.completion(tokenizer), outcome=outcome)


async def _tool_schemas(env) -> list[dict[str, Any]]:
    """The taskset's tools as the harness shows them (``connect_mcp``'s names and schemas), listed in this process.

    In verifiers' order: the servers each episode starts (``Task.toolsets``), then those shared by the run
    (``Taskset.toolsets``).
    """
    from mcp.server.mcpserver import MCPServer

    taskset = env.taskset
    first = next(iter(taskset), None)
    per_episode = list(type(first).toolsets(first.config)) if first is not None else []
    schemas = []
    for toolset in [*per_episode, *type(taskset).toolsets(taskset.config)]:
        server = MCPServer(toolset.server_name or "tools")
        toolset.register(server)
        for tool in await server.list_tools():
            name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            schemas.append({"type": "function", "function": {
                "name": name, "description": tool.description or "", "parameters": tool.input_schema}})  # fmt: skip
    return schemas
