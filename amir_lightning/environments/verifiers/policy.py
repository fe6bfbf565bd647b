"""The policy as the model verifiers' episodes talk to (``VerifiersEnvironment``, ``environment.py``).

verifiers' interception server asks its client for each model call. ``hook_clients`` makes that client, for the
episodes of a run here, a ``PolicyClient``: it renders the call's messages with the policy's chat template (tool
results as ``ToolReplies`` writes them), waits in ``Batches`` until every unfinished episode has asked, and returns
the turn the run's engine sampled, its tool calls read by the policy's parser. Each episode's tokens are kept as
they were sampled (``TaskEpisode``); of a tool's result, the episode keeps what the policy reads
(``kept_result``: ``max_reply_tokens``' worth of text, however much the tool printed), and a result that is not
valid Unicode (a lone surrogate, which verifiers' interception server takes from JSON that escapes one) is an error
naming the tool, as for ``data.tools``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from amir_lightning.data.base import Prompt
from amir_lightning.data.verifiers_tasks import import_verifiers
from amir_lightning.engines.base import Completion, SamplingConfig
from amir_lightning.environments.base import EpisodeRecord
from amir_lightning.environments.replies import kept_result, reply_char_bound

#: The base URL the episodes' model calls name (per environment); the interception server's client for it is the
#: environment's policy client.
URL = "http://amir-lightning.invalid/{}/v1"
CLIENTS: dict[str, PolicyClient] = {}


@dataclass
class TaskEpisode(EpisodeRecord):
    """An episode verifiers runs: its record, and where its conversation stands."""

    seen: int = 0  # the messages its tokens hold (the prompt's, the replies', the results')
    last_turn: list[int] = field(default_factory=list)  # the policy's last turn (its closing depends on it)
    pending_calls: list[dict[str, Any]] = field(default_factory=list)  # the last turn's calls, by id


class Batches:
    """One rollout's episodes: their records, and the turns waiting to be sampled.

    Every unfinished episode asks for its next turn before the batch goes to the sampling thread, so a batch is a
    function of the episodes' progress, never of timing.
    """

    def __init__(self, prompt_of: list[int], prompt_ids, sampling: SamplingConfig, room, loop) -> None:
        self.records = [TaskEpisode(prompt_index=p, messages=[], calls=[]) for p in prompt_of]
        self.prompt_ids, self.sampling, self.room, self.loop = prompt_ids, sampling, room, loop
        self.requests: queue.Queue = queue.Queue()
        self.waiting: dict[int, tuple[list[int], asyncio.Future]] = {}
        self.sampling_now: dict[int, asyncio.Future] = {}  # the batch with the sampling thread, by episode
        self.finished = 0
        self.checked: set[int] = set()  # the prompts whose first messages were found to render as drawn

    async def sample(self, index: int, ids: list[int]) -> Completion:
        """Episode ``index``'s next turn from prompt and episode tokens ``ids``, once its batch is sampled."""
        future = self.loop.create_future()
        self.waiting[index] = (ids, future)
        self._flush()
        return await future

    def finish(self, index: int) -> None:
        """Episode ``index`` asks no more (a batch may then be complete)."""
        self.finished += 1
        self._flush()

    def _flush(self) -> None:
        if self.waiting and len(self.waiting) + self.finished == len(self.records):
            batch = sorted(self.waiting.items())
            self.waiting = {}
            self.requests.put([(index, ids) for index, (ids, _) in batch])
            self.sampling_now = {index: future for index, (_, future) in batch}

    def deliver(self, batch, completions: list[Completion]) -> None:
        """The sampling thread's turns for ``batch``, each to the episode waiting on it."""
        for (index, _), completion in zip(batch, completions):
            self.sampling_now[index].set_result(completion)


class PolicyClient:
    """The model verifiers' interception server asks: the policy, through ``Batches``'s batches (a ``vf.Client``)."""

    def __init__(self, tokenizer, chat, parser, replies, tool_names: set[str]) -> None:
        self.tokenizer, self.chat, self.parser, self.replies = tokenizer, chat, parser, replies
        self.tool_names = tool_names
        # A result's characters that hold all the policy reads of it (``reply_char_bound``): the rest is never kept.
        self.max_chars = reply_char_bound(tokenizer, replies.max_reply_tokens) if replies is not None else 0
        self.runs: dict[str, Batches] = {}  # the rollouts in progress, by the key their episodes' model names hold

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
            if record.prompt_index not in run.checked:  # its n episodes ask with the same messages
                self._check_prompt(messages, run.prompt_ids[record.prompt_index])
                run.checked.add(record.prompt_index)
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

    def _add_results(self, record: TaskEpisode, messages: list[dict[str, Any]]) -> None:
        """Add the tool results since the policy's last turn (the template's text around them; masked)."""
        new = messages[record.seen :]
        if not new or any(m.get("role") != "tool" for m in new) or self.replies is None:
            roles = [m.get("role") for m in new]
            raise ValueError(f"after a policy turn the harness sent {roles}, not the results of its tool calls")
        by_id = {c["id"]: c for c in record.pending_calls}
        calls = [by_id.get(m.get("tool_call_id"), {"name": m.get("name") or "", "arguments": ""}) for m in new]
        kept = [self._kept(call["name"], _text(m.get("content"))) for call, m in zip(calls, new)]
        ids, truncated = self.replies.tokens([result for result, _ in kept], record.last_turn)
        record.add(ids)
        record.tool_truncated += truncated
        for call, (result, unreadable) in zip(calls, kept):
            error = unreadable or result.startswith("error: ")
            record.calls.append({"name": call["name"], "arguments": call["arguments"], "result": result,
                                 "error": error, "seconds": 0.0})  # fmt: skip
            record.tool_errors += error
            record.messages.append({"role": "tool", "name": call["name"], "content": result})

    def _kept(self, tool: str, result: str) -> tuple[str, bool]:
        """What the episode keeps of a result (``kept_result``: what the policy reads of it), and whether unreadable."""
        return kept_result(self.tokenizer, tool, result[: self.max_chars], self.replies.max_reply_tokens)

    def _read(self, record: TaskEpisode, completion: Completion) -> tuple[str, list]:
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


def hook_clients() -> None:
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
        for key, client in CLIENTS.items():
            if url == URL.format(key):
                return client
        return original(config)

    resolve_client.amir = True
    server.resolve_client = resolve_client
