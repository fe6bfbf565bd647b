"""Environments from verifiers (0.4: ``pip install 'amir-lightning[verifiers]'``), scored by their own rewards.

A taskset written for prime-rl trains here unchanged. verifiers runs an episode as a harness talking to the model
through an interception server that records every call into the episode's trace, with the taskset's tools as MCP
servers, then scores the trace with the task's ``@vf.reward`` functions. Here:

- the harness is ``environments/verifiers/harness.py``: a chat loop in this process, the tool calls going to the
  taskset's tool servers and their results coming back as ``tool`` messages;
- the interception server's client is the policy (``PolicyClient``, ``environments/verifiers/policy.py``): each call
  is sampled by the run's engine, together with the calls of every other episode then waiting (one batch per turn,
  seeded by its place in the run), and its tool calls are read by the policy's own parser (``tool_parser``);
- an episode's tokens are the prompt's as the run rendered it, the policy's turns (trained on) and the chat
  template's text with the tool results between them (masked, ``ToolReplies``; of a result, the episode keeps what
  the policy reads), so the trainer scores exactly what the engine sampled, and verifiers' trace holds one branch;
- the trace's reward, its named rewards and metrics go with the completion (``Completion.outcome``) to
  ``EnvironmentReward``; the taskset's rewards and metrics are watched as the run's own rewards are
  (``scoring.py``): one that raises or returns what is not a score stops the run naming it, one that
  runs long is named every ``reward_warn_s`` seconds, and a stop asked for (SIGTERM, Ctrl-C) ends the wait on them.

Harnesses that run a program of their own (codex, claude code, ...) are for an agent's sandbox, not a training
loop: they are refused at start, as is a chat template that shows no tools when the taskset has some. A taskset's
tool servers shared by the run start once; those of each task (``Task.toolsets``) start with every episode, as in
verifiers (a process each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.verifiers_tasks import import_verifiers, load_tasks, task_messages, taskset_config
from amir_lightning.engines.base import Completion, turn_seed
from amir_lightning.environments.base import Environment, EpisodeBatch
from amir_lightning.environments.tool_calls import ToolCallParser
from amir_lightning.environments.tools import ToolReplies, refuse_hidden_tools
from amir_lightning.environments.verifiers.policy import CLIENTS, URL, Batches, PolicyClient, TaskEpisode, hook_clients
from amir_lightning.environments.verifiers.scoring import Scoring
from amir_lightning.helpers import stops
from amir_lightning.helpers.validation import check_number, raise_errors

log = logging.getLogger(__name__)

KEY = "data.environment.init_args"
#: How often the thread waiting on the episodes looks for a stop (SIGTERM, Ctrl-C), in seconds, as a wait on tools does.
STOP_CHECK_S = 0.1
#: How long verifiers' event loop is given to end the episodes of a rollout given up (a stop, an error) and to answer
#: ``close``, before it is taken as held by the taskset's code.
HELD_S = 2.0
#: The harness every episode runs with (``environments/verifiers/harness.py``), by the id verifiers loads it with: it
#: imports a harness id as a top-level module, so the module is registered under this name.
HARNESS = "amir_lightning_harness"
_IDS = itertools.count()


def env_config(environment: str | dict[str, Any], key: str, max_turns: int):
    """The verifiers environment config of ``environment``, its episodes run by this project's harness here.

    Raises:
        ValueError: The config names another harness (one that runs a program of its own), or no taskset.
    """
    import sys

    from amir_lightning.environments.verifiers import harness as verifiers_harness

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
    """A verifiers taskset's episodes, sampled by the policy and scored by the taskset.

    Give ``data.prompts`` a ``VerifiersTasks`` of the same taskset and ``data.rewards`` an ``EnvironmentReward``.

    Args:
        environment: The taskset's id (its importable module), a verifiers environment config as
            ``vf.resolve_env_config`` takes it (``{taskset: {id: ...}}``, its agent's ``timeout`` and limits), or
            in Python an environment ``vf.load_environment`` loaded (its harness must be verifiers' chat loop,
            ``null``, which runs here as ``environments/verifiers/harness.py``).
        tool_parser: How a turn's tool calls are read: one of vLLM's tool parsers by name (``hermes`` for Qwen2.5 and
            Hermes-format templates), or ``response_template`` (the tokenizer's own).
        max_turns: Policy turns per episode (verifiers' ``agent.max_turns``); an episode still calling tools at the
            last is cut.
        max_reply_tokens: Longest tool result in tokens (a longer one is cut, and counted).
        reward_warn_s: Say so when one of the taskset's rewards or metrics has run this many seconds, naming it, and
            again as often while it runs (as ``data.rollout.reward_warn_s`` for the run's rewards); the same when the
            episodes' tools keep them this long without a turn. verifiers' own deadline is the config's
            ``agent.timeout.scoring``.
    """

    def __init__(
        self,
        environment: str | dict[str, Any] | Any,
        tool_parser: str = "hermes",
        max_turns: int = 4,
        max_reply_tokens: int = 256,
        reward_warn_s: float = 60.0,
    ) -> None:
        super().__init__(max_turns=max_turns, max_reply_tokens=max_reply_tokens)
        errors: list[str] = []
        check_number(errors, f"{KEY}.reward_warn_s", reward_warn_s, gt=0)
        raise_errors(errors)
        self.reward_warn_s = reward_warn_s
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
        self._runs: set[asyncio.Task] = set()  # the rollouts running on the loop (close lets those given up end)
        self._starting = threading.Lock()  # a rollout sampled ahead and a validation may start it at once
        for name in ("verifiers", "aiohttp.access", "httpx"):  # a line per episode and per call; warnings show
            logging.getLogger(name).setLevel(logging.WARNING)

    @override
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return list(self.schemas) or None

    @override
    def prepare(self, tokenizer, chat) -> None:
        """Read the policy's chat template (the text between two turns) and its tool-call parser, once.

        Raises:
            ValueError: The taskset has tools and the template shows none (``refuse_hidden_tools``), or cannot show
                a tool's result (``ToolReplies``).
        """
        if self.schemas:
            whose = f"the tools of the verifiers taskset {self.config.taskset.id!r}"
            refuse_hidden_tools(tokenizer, chat, self.schemas, f"{KEY}.environment", whose)
        parser = ToolCallParser(self.tool_parser, tokenizer, self.schemas) if self.schemas else None
        replies = ToolReplies(tokenizer, chat, self.schemas[0]["function"]["name"], self.max_reply_tokens) if (
            self.schemas
        ) else None  # fmt: skip
        self._client = PolicyClient(tokenizer, chat, parser, replies, {s["function"]["name"] for s in self.schemas})

    @override
    def reset(self, prompt: Prompt) -> None:
        return None  # verifiers keeps each episode's state

    @override
    def episodes(self, batch: EpisodeBatch) -> list[list[Completion]]:
        """``batch.n`` episodes of each prompt's task, run by verifiers while this thread samples their turns.

        Raises:
            RewardError: One of the taskset's rewards or metrics raised, returned what is not a score, or ran over
                verifiers' scoring deadline (the first episode's, in order).
        """
        if self._client is None:
            raise RuntimeError("VerifiersEnvironment.prepare must run before its first episode")
        prompts, prompt_ids, n, sampling = batch.prompts, batch.prompt_ids, batch.n, batch.sampling
        engine, seed, tokenizer, room = batch.engine, batch.seed, batch.tokenizer, batch.room
        tasks = [self._task(prompt) for prompt in prompts]  # a stray prompt is refused before anything starts
        loop = self._start()
        run = Batches([i for i in range(len(prompts)) for _ in range(n)], prompt_ids, sampling, room, loop)
        scoring = Scoring(self.config.taskset.id)
        key = str(next(_IDS))  # a rollout sampled ahead and a validation can run at once
        self._client.runs[key] = run
        ended = threading.Event()
        done = asyncio.run_coroutine_threadsafe(self._run(run, key, tasks, n, scoring, ended), loop)
        try:
            for turn in itertools.count():
                batch = self._next_batch(run, scoring)
                if batch is None:
                    break
                sampled = engine.generate([ids for _, ids in batch], 1, sampling, turn_seed(seed, turn))
                loop.call_soon_threadsafe(run.deliver, batch, [group[0] for group in sampled])
            episodes = done.result()
        except BaseException:
            done.cancel()
            if not ended.wait(HELD_S):  # verifiers aborts each episode (its clean-up), unless its loop is held
                log.warning("verifiers taskset %r: its episodes did not end within %g s of being given up (a blocking "
                            "call in the taskset's async code holds verifiers' event loop)", self.config.taskset.id,
                            HELD_S)  # fmt: skip
            raise
        finally:
            del self._client.runs[key]
        out: list[list[Completion]] = [[] for _ in prompts]
        for index, (record, episode) in enumerate(zip(run.records, episodes)):
            task = tasks[record.prompt_index]
            out[record.prompt_index].append(_completion(record, episode, tokenizer, task, index, scoring))
        return out

    def _next_batch(self, run: Batches, scoring: Scoring) -> list | None:
        """The next turns to sample (``None``: every episode ended), waited for as long as the taskset's code runs.

        Every ``reward_warn_s`` seconds without them, the rewards and metrics still running are named, or else the
        episodes still running their tools are counted; a stop asked for (SIGTERM, Ctrl-C) raises what the run makes
        of it (``helpers/stops.py``).
        """
        said = time.monotonic()
        while True:
            try:
                return run.requests.get(timeout=STOP_CHECK_S)
            except queue.Empty:
                stops.raise_if_stopped()
            if scoring.say_running(self.reward_warn_s, f"{KEY}.reward_warn_s"):
                said = time.monotonic()
            elif time.monotonic() - said >= self.reward_warn_s:
                said = time.monotonic()
                running = len(run.records) - run.finished - len(run.waiting)
                log.warning("verifiers taskset %r: %d episodes have not asked for a turn in %.0f s (verifiers runs "
                            "their tools, setup or clean-up; %s.reward_warn_s)", self.config.taskset.id, running,
                            self.reward_warn_s, KEY)  # fmt: skip

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

    async def _run(self, run: Batches, key: str, tasks: list, n: int, scoring: Scoring, ended: threading.Event) -> list:
        """The episodes of ``tasks`` (``n`` each) on verifiers' event loop; ``ended`` is set once every one ended."""
        self._runs.add(asyncio.current_task())
        vf = import_verifiers("data.environment")
        slots = [slot for task in tasks for slot in self.env.slots(task, n=n)]

        async def one(index: int, slot):
            context = vf.ModelContext(
                model=f"amir-{key}-{index}", client=vf.TrainClientConfig(base_url=URL.format(self._id))
            )
            try:  # the episode's task scored through the watch
                return await self.env.run_slot(replace(slot, task=scoring.task(slot.task, index)), context)
            finally:
                run.finish(index)

        try:
            return await asyncio.gather(*(one(index, slot) for index, slot in enumerate(slots)))
        finally:
            run.requests.put(None)
            ended.set()
            self._runs.discard(asyncio.current_task())

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
        serving, self._serving = self._serving, None
        CLIENTS.pop(self._id, None)
        answered = threading.Event()
        loop.call_soon_threadsafe(answered.set)
        closed = asyncio.run_coroutine_threadsafe(self._shut(serving), loop)
        closed.add_done_callback(lambda _: loop.call_soon_threadsafe(loop.stop))
        if not answered.wait(HELD_S):  # a blocking call in the taskset's async code (named above) holds the loop
            log.warning("verifiers' event loop is held by the taskset's code (a blocking call in an async reward, "
                        "metric or tool): its servers stop once the call returns, or with this process")  # fmt: skip
            return
        try:
            closed.result(timeout=60)
        except TimeoutError:
            log.warning("verifiers did not stop the taskset's servers within 60 s: they end with this process")

    async def _shut(self, serving: contextlib.AsyncExitStack | None) -> None:
        """On the loop: let the rollouts given up end, stop serving, then end what is left, as ``asyncio.run`` does.

        verifiers aborts each episode of a rollout given up; a task still pending when the loop stops is never awaited.
        """
        if self._runs:
            await asyncio.wait(list(self._runs), timeout=HELD_S)
        if serving is not None:
            await serving.aclose()
        if left := asyncio.all_tasks() - {asyncio.current_task()}:
            for task in left:
                task.cancel()
            await asyncio.wait(left, timeout=HELD_S)


def _completion(record: TaskEpisode, episode, tokenizer, task, index: int, scoring: Scoring) -> Completion:
    """The episode as a completion, with the taskset's scoring of it.

    Raises:
        RewardError: A reward or metric of the taskset failed on it (``Scoring``).
        ValueError: verifiers failed it otherwise (its errors, and its traces').
    """
    if not episode.ok:
        if index in scoring.errors:
            raise scoring.errors[index]
        errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
        said = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
        raise ValueError(f"{KEY}.environment: episode {index} (task {task.data.prompt!r:.60}) failed: {said}")
    trace = episode.traces[0]
    if trace.stop_condition == "scoring_timeout":  # its rewards were cut: it has no score to train on
        raise scoring.cut_error(index)
    if record.messages and record.messages[-1].get("tool_calls"):
        record.tool_cut = True  # still calling tools when verifiers' limits ended it
    rewards = {name: r.score for name, r in trace.rewards.items() if r is not None and r.score is not None}
    metrics = {name: float(v) for name, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
    outcome = {"reward": None if trace.reward is None else float(trace.reward), "rewards": rewards, "metrics": metrics}
    completion = record.completion(tokenizer)
    return replace(completion, episode=replace(completion.episode, outcome=outcome))


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
