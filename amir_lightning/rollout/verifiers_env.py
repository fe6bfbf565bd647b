"""Environments from verifiers (0.4: ``pip install 'amir-lightning[verifiers]'``), scored by their own rewards.

A taskset written for prime-rl trains here unchanged. verifiers runs an episode as a harness talking to the model
through an interception server that records every call into the episode's trace, with the taskset's tools as MCP
servers, then scores the trace with the task's ``@vf.reward`` functions. Here:

- the harness is ``rollout/verifiers_harness.py``: a chat loop in this process, the tool calls going to the
  taskset's tool servers and their results coming back as ``tool`` messages;
- the interception server's client is the policy (``_PolicyClient``): each call is sampled by the run's engine,
  together with the calls of every other episode then waiting (one batch per turn, seeded by its place in the run),
  and its tool calls are read by the policy's own parser (``tool_parser``);
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
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.verifiers_tasks import import_verifiers, load_tasks, task_messages, taskset_config
from amir_lightning.rollout.engine import Completion, SamplingConfig
from amir_lightning.rollout.episodes import Environment, EpisodeRecord
from amir_lightning.rollout.tool_calls import ToolCallParser
from amir_lightning.rollout.tools import ToolReplies

KEY = "data.environment.init_args"
#: The harness every episode runs with (``rollout/verifiers_harness.py``), by the id verifiers loads it with: it
#: imports a harness id as a top-level module, so the module is registered under this name.
HARNESS = "amir_lightning_harness"
#: The base URL the episodes' model calls name; the interception server's client for it is the policy.
_URL = "http://amir-lightning.invalid/{}/v1"
_CLIENTS: dict[str, _PolicyClient] = {}
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
        self._client: _PolicyClient | None = None
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
        self._client = _PolicyClient(tokenizer, chat, parser, replies, {s["function"]["name"] for s in self.schemas})

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
        generate: Callable[[list[list[int]], int, SamplingConfig, int], list[list[Completion]]],
        tokenizer,
        room: int | None = None,
    ) -> list[list[Completion]]:
        """``n`` episodes of each prompt's task, run by verifiers while this thread samples their turns."""
        if self._client is None:
            raise RuntimeError("VerifiersEnvironment.prepare must run before its first episode")
        tasks = [self._task(prompt) for prompt in prompts]  # a stray prompt is refused before anything starts
        loop = self._start()
        run = _Run([i for i in range(len(prompts)) for _ in range(n)], prompt_ids, sampling, room, loop)
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

    async def _run(self, run: _Run, key: str, tasks: list, n: int) -> list:
        vf = import_verifiers("data.environment")
        slots = [slot for task in tasks for slot in self.env.slots(task, n=n)]

        async def one(index: int, slot):
            context = vf.ModelContext(
                model=f"amir-{key}-{index}", client=vf.TrainClientConfig(base_url=_URL.format(self._id))
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
        _hook_clients()
        _CLIENTS[self._id] = self._client
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
        _CLIENTS.pop(self._id, None)


@dataclass
class _Episode(EpisodeRecord):
    """An episode verifiers runs: its record, and where its conversation stands."""

    seen: int = 0  # the messages its tokens hold (the prompt's, the replies', the results')
    last_turn: list[int] = field(default_factory=list)  # the policy's last turn (its closing depends on it)
    pending_calls: list[dict[str, Any]] = field(default_factory=list)  # the last turn's calls, by id


class _Run:
    """One rollout's episodes: their records, and the turns waiting to be sampled.

    Every unfinished episode asks for its next turn before the batch goes to the sampling thread, so a batch is a
    function of the episodes' progress, never of timing.
    """

    def __init__(self, prompt_of: list[int], prompt_ids, sampling: SamplingConfig, room, loop) -> None:
        self.records = [_Episode(p, None, messages=[], calls=[]) for p in prompt_of]
        self.prompt_ids, self.sampling, self.room, self.loop = prompt_ids, sampling, room, loop
        self.requests: queue.Queue = queue.Queue()
        self.waiting: dict[int, tuple[list[int], asyncio.Future]] = {}
        self.finished = 0

    async def sample(self, index: int, ids: list[int]) -> Completion:
        future = self.loop.create_future()
        self.waiting[index] = (ids, future)
        self._flush()
        return await future

    def finish(self, index: int) -> None:
        self.finished += 1
        self._flush()

    def _flush(self) -> None:
        if self.waiting and len(self.waiting) + self.finished == len(self.records):
            batch = sorted(self.waiting.items())
            self.waiting = {}
            self.requests.put([(index, ids) for index, (ids, _) in batch])
            self._futures = {index: future for index, (_, future) in batch}

    def deliver(self, batch, completions: list[Completion]) -> None:
        for (index, _), completion in zip(batch, completions):
            self._futures[index].set_result(completion)


class _PolicyClient:
    """The model verifiers' interception server asks: the policy, through ``_Run``'s batches (a ``vf.Client``)."""

    def __init__(self, tokenizer, chat, parser, replies, tool_names: set[str]) -> None:
        self.tokenizer, self.chat, self.parser, self.replies = tokenizer, chat, parser, replies
        self.tool_names = tool_names
        self.runs: dict[str, _Run] = {}  # the rollouts in progress, by the key their episodes' model names hold

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):  # noqa: D102
        vf = import_verifiers("data.environment")
        from verifiers.v1.clients.train import serialize_completion
        from verifiers.v1.dialects.chat import message_to_wire

        _, key, index = body["model"].split("-")
        run = self.runs[key]
        record = run.records[int(index)]
        request = turn if turn is not None else dialect.parse_request(body)
        messages = [message_to_wire(m) for m in (request.prompt if turn is not None else request.messages)]
        if record.turns == 0:
            names = {t.name for t in request.tools or []}
            if names != self.tool_names:
                shown = sorted(self.tool_names)
                raise ValueError(f"the episode's tools {sorted(names)} are not those shown at start {shown}")
            self._check_prompt(messages, run.prompt_ids[record.prompt_index])
        else:
            self._add_results(record, messages)
        record.seen = len(messages) + 1  # and the reply this call makes
        ids = [*run.prompt_ids[record.prompt_index], *record.token_ids]
        if run.room is not None and len(ids) + run.sampling.max_new_tokens > run.room:
            record.finish_reason, record.tool_cut = "length", True  # no room for another turn: cut
            completion = Completion([], "", [], "length")
        else:
            completion = await run.sample(int(index), ids)
        record.add(completion.token_ids, completion.sampling_logps)
        record.turns += bool(completion.token_ids)
        record.finish_reason = completion.finish_reason
        record.last_turn = list(completion.token_ids)
        content, calls = self._read(record, completion)
        message = vf.AssistantMessage(content=content or None, tool_calls=calls or None)
        said = {"tool_calls": [_call_message(c) for c in calls]} if calls else {}
        record.messages.append({"role": "assistant", "content": content, **said})
        model = body["model"]
        response = vf.Response(
            id=f"{model}-{record.turns}",
            created=int(time.time()),
            model=model,
            message=message,
            finish_reason="tool_calls" if calls else completion.finish_reason,
            usage=vf.Usage(prompt_tokens=len(ids), completion_tokens=len(completion.token_ids)),
            tokens=vf.TurnTokens(
                prompt_ids=ids,
                completion_ids=list(completion.token_ids),
                completion_logprobs=list(completion.sampling_logps),
            ),
        )
        response.raw = serialize_completion(response, model)  # what the harness's OpenAI client reads
        return response

    async def close(self) -> None:  # noqa: D102 - the interception server closes its clients
        return None

    def _check_prompt(self, messages: list[dict[str, Any]], prompt_ids: list[int]) -> None:
        """The first turn's messages, rendered by the policy's template, must be the prompt the run rendered."""
        if self.chat.render(self.tokenizer, Prompt("", "", messages=tuple(messages))) != list(prompt_ids):
            raise ValueError("the episode's first messages are not the task's prompt as the run rendered it")

    def _add_results(self, record: _Episode, messages: list[dict[str, Any]]) -> None:
        """Add the tool results since the policy's last turn (the template's text around them; masked)."""
        new = messages[record.seen :]
        if not new or any(m.get("role") != "tool" for m in new) or self.replies is None:
            roles = [m.get("role") for m in new]
            raise ValueError(f"after a policy turn the harness sent {roles}, not the results of its tool calls")
        results = [_text(m.get("content")) for m in new]
        ids, truncated = self.replies.tokens(results, record.last_turn)
        record.add(ids)
        record.tool_truncated += truncated
        names = {c["id"]: c for c in record.pending_calls}
        for m, result in zip(new, results):
            call = names.get(m.get("tool_call_id"), {"name": "", "arguments": ""})
            error = result.startswith("error: ")
            record.calls.append({"name": call["name"], "arguments": call["arguments"], "result": result,
                                 "error": error, "seconds": 0.0})  # fmt: skip
            record.tool_errors += error
            record.messages.append({"role": "tool", "name": call["name"], "content": result})

    def _read(self, record: _Episode, completion: Completion) -> tuple[str, list]:
        """The turn's text and its tool calls (``vf.ToolCall``), as the policy's parser reads them."""
        vf = import_verifiers("data.environment")
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        record.pending_calls = []
        if self.parser is None or completion.finish_reason != "stop":
            if self.parser is not None and self.parser.parse(text).calls:
                record.tool_cut = True  # a call cut by the length limit never runs
            return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), []
        parsed = self.parser.parse(text)
        record.tool_malformed += parsed.malformed is not None
        calls = []
        for number, call in enumerate(parsed.calls):
            arguments = json.dumps(call.arguments) if call.arguments is not None else call.raw_arguments
            calls.append(vf.ToolCall(id=f"call_{record.turns}_{number}", name=call.name, arguments=arguments))
            record.pending_calls.append({"id": calls[-1].id, "name": call.name, "arguments": call.arguments})
        record.tool_calls += len(calls)
        return parsed.content.strip() if calls else parsed.content, calls


def _call_message(call) -> dict[str, Any]:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _text(content) -> str:
    """A tool message's content as text (a list of text parts joined)."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", part)) if isinstance(part, dict) else str(part) for part in content)
    return "" if content is None else str(content)


def _completion(record: _Episode, episode, tokenizer, task, index: int) -> Completion:
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


def _hook_clients() -> None:
    """Have verifiers' interception server ask the policy for the episodes' calls (once per process).

    verifiers builds its client from the episode's client config (``resolve_client``); a config naming this
    project's URL gets the environment's policy client instead. A pinned verifiers (0.4) keeps this seam stable.
    """
    import verifiers.v1.interception.server as server

    if getattr(server.resolve_client, "amir", False):
        return
    original = server.resolve_client

    def resolve_client(config):
        url = getattr(config, "base_url", "") or ""
        for key, client in _CLIENTS.items():
            if url == _URL.format(key):
                return client
        return original(config)

    resolve_client.amir = True
    server.resolve_client = resolve_client


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
