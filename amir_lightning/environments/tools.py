r"""Tools as Python functions, called as the policy's chat template writes calls (``data.tools``, ``ToolEnvironment``).

A tool is a typed function with a Google-style docstring; ``transformers.utils.get_json_schema`` makes its schema and
the policy's chat template shows the schemas (``apply_chat_template(..., tools=...)``), as at inference. A policy turn
runs to its end-of-turn token; the model's own parser reads its calls (``tool_calls.py``: a vLLM tool parser
by name, or the tokenizer's response template), several at once if it wrote several. Each call runs, and the results
come back as ``tool`` messages rendered by the same template::

    prompt (tools in the system turn) | policy: "... <tool_call>{...}</tool_call><|im_end|>"
      | template: "\n<|im_start|>user\n<tool_response>\n296\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
      | policy: "37 * 8 = 296<|im_end|>"

The template's tokens between two policy turns, and the results, are context, not the policy's: masked out of the
loss, as every environment's replies are (``environments/base.py``). A result is tokenised as text (special-token text
in it cannot write the template's control tokens), and an episode keeps of it (its messages, its calls) only the
prefix the policy's ``max_reply_tokens`` are read from (``kept_reply``), however much the tool printed.

The calls of every episode's turn run together, under one ``timeout_s`` (``tool_runs.py``): a tool that hangs holds
a turn ``timeout_s`` once, a warning names it, and a stop (SIGTERM, Ctrl-C) ends the wait. What the policy reads when
a call goes wrong (each an ``error: ...`` result; the episode goes on):

========================================  ==========================================================================
malformed call (opened, does not parse)   one result naming what was wrong; the turn counts in ``tools/malformed_frac``
unknown tool, bad arguments               the tool's name and what was wrong with the arguments
a tool that raises                        the exception's type and message
a tool over ``timeout_s``                 that it did not answer in time (its thread is left to finish: Python cannot
                                          stop one; a tool that must be stopped should run its work in a process)
a result that is not valid Unicode        the tool's name and where (a lone surrogate, which no tokenizer reads)
calls past ``max_tool_calls``             that the episode's calls are spent
========================================  ==========================================================================

Errors count in ``tools/error_frac`` (of calls). A turn cut at ``max_new_tokens`` in the middle of a call, and an
episode still calling at ``max_turns``, end the episode (``tools/cut_frac``). A tool's changes to the process's state
(working directory, grad mode, default dtype, threads) are put back after each turn's calls, as a reward's are. A tool
whose signature no call by name can reach (``*args``, ``**kwargs``, positional-only), or a chat template that shows
no tools, is refused at start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override

from amir_lightning.data.base import Prompt
from amir_lightning.data.template_checks import PROBE_QUESTION, ignores_tools
from amir_lightning.environments.base import Environment
from amir_lightning.environments.replies import encode_reply, kept_result, reply_char_bound
from amir_lightning.environments.tool_calls import ParsedTurn, ToolCall, ToolCallParser
from amir_lightning.environments.tool_functions import argument_problem, load_tool, signature_problem, tool_schema
from amir_lightning.environments.tool_runs import CallResult, run_together
from amir_lightning.helpers.validation import check_number, raise_errors

#: Stand-ins rendered by the chat template where the assistant's text and each result go, then cut out.
_ANSWER = "\u2063amir-answer\u2063"
_RESULT = "\u2063amir-result-{}\u2063"

__all__ = ["ToolEnvironment", "argument_problem", "load_tool", "signature_problem", "tool_schema"]


@dataclass
class CallRecord:
    """A call as rewards see it (``tool_calls``): the tool, its arguments, what came back and whether an error."""

    name: str
    arguments: dict[str, Any] | str
    result: str
    error: bool
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The record as a plain dict (rewards get these; checkpoints keep them)."""
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "error": self.error,
                "seconds": self.seconds}  # fmt: skip


@dataclass
class TurnReply:
    """What follows a policy turn that called tools: the tokens, and what they say.

    Attributes:
        token_ids: The template's tokens closing the turn, the results as tool messages, the next turn's header.
        calls: The calls made (errors included), in order.
        messages: The turn's tool messages (``role: tool``).
        malformed: Whether the turn's attempt at a call did not parse.
        truncated: Results cut at ``max_reply_tokens``.
    """

    token_ids: list[int]
    calls: list[CallRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False
    truncated: int = 0


def refuse_hidden_tools(tokenizer, chat, schemas: list[dict[str, Any]], key: str, whose: str = "the tools") -> None:
    """Refuse a chat template that renders the prompt the same with and without ``schemas`` (``ignores_tools``).

    ``key`` names the setting that brought the tools, ``whose`` says whose tools they are.

    Raises:
        ValueError: The template shows no tools (SmolLM2's ChatML): the policy would never see their schemas.
    """
    messages = chat.messages(Prompt(question=PROBE_QUESTION, answer=""))
    if ignores_tools(tokenizer, chat.template, chat.template_kwargs, messages, schemas):
        which = "data.chat_template" if chat.template else f"the chat template of {tokenizer.name_or_path}"
        raise ValueError(
            f"{key}: {which} renders the prompt the same with and without {whose}, so the policy would never see "
            "their schemas: give one that shows them in data.chat_template (configs/templates/chatml_tools.jinja "
            "does, in ChatML)"
        )


class ToolReplies:
    """What the chat template writes after a policy turn that called tools, the results in it (read once).

    An episode's tokens then extend the turns before it (``ToolEnvironment``, ``VerifiersEnvironment``). The template
    renders a conversation that ends with an assistant turn, then the same with ``k`` tool messages and the next
    turn's header; what the second adds to the first is the text between the turns, the results' places in it marked.
    The template's text is tokenised with its control tokens, each result as text (``encode_reply``).

    Args:
        tokenizer: The policy's tokenizer.
        chat: The policy's chat format (its template, tools and system prompt).
        tool_name: A tool's name, for the ``name`` of the tool messages rendered (templates that show it).
        max_reply_tokens: Longest result in tokens (a longer one is cut, and counted).

    Raises:
        ValueError: The template does not show an assistant's message or a tool message's content as given, or
            renders the turns before a tool message otherwise once one follows.
    """

    def __init__(self, tokenizer, chat, tool_name: str, max_reply_tokens: int) -> None:
        self._tokenizer, self._chat, self._name, self.max_reply_tokens = tokenizer, chat, tool_name, max_reply_tokens
        self._pieces: dict[int, list[str | int]] = {}  # per result count: template text, or a result's index
        before = self._render(0)
        end = before.find(_ANSWER)
        if end < 0:
            raise ValueError("data.chat_template does not show the assistant's message as given: tool calls need a "
                             "template that renders each message's content")  # fmt: skip
        self._before, self.closing = before, before[end + len(_ANSWER) :]
        self.pieces(1)  # a template that cannot show a tool message is refused now, not at the first call

    def _render(self, results: int) -> str:
        messages = self._chat.messages(Prompt(question="1 + 1", answer=""))
        messages.append({"role": "assistant", "content": _ANSWER})
        messages += [{"role": "tool", "name": self._name, "content": _RESULT.format(i)} for i in range(results)]
        return self._chat.text(self._tokenizer, messages, add_generation_prompt=results > 0)

    def pieces(self, results: int) -> list[str | int]:
        """The template's text after a turn with ``results`` results, as text pieces and the results' places.

        The text that closes the assistant's turn (``closing``) comes before the first piece.
        """
        if results not in self._pieces:
            after = self._render(results)
            if not after.startswith(self._before):
                raise ValueError("data.chat_template renders the turns before a tool message otherwise once one "
                                 "follows: the episode's tokens could not be the conversation's")  # fmt: skip
            text, pieces = after[len(self._before) :], []
            for index in range(results):
                marker = _RESULT.format(index)
                if marker not in text:
                    raise ValueError("data.chat_template does not show a tool message's content as given (role "
                                     "tool): the policy would not read its tools' results")  # fmt: skip
                head, text = text.split(marker, 1)
                pieces += [head, index]
            self._pieces[results] = [*pieces, text]
        return self._pieces[results]

    def tokens(self, results: Sequence[str], turn_ids: list[int]) -> tuple[list[int], int]:
        """The tokens after the policy's turn ``turn_ids``, and how many results were cut at ``max_reply_tokens``.

        They are the turn's closing (less the end-of-turn token the policy wrote), the results, the next turn's header.
        """
        closing = self.closing
        last = self._tokenizer.decode(turn_ids[-1:], skip_special_tokens=False) if turn_ids else ""
        if last and closing.startswith(last):  # the policy wrote the end-of-turn token itself
            closing = closing[len(last) :]
        ids: list[int] = []
        truncated = 0
        head, *rest = self.pieces(len(results))
        for piece in [closing + head, *rest]:
            if isinstance(piece, int):  # a result: text, cut at max_reply_tokens
                result_ids, cut = encode_reply(self._tokenizer, results[piece], self.max_reply_tokens)
                ids += result_ids
                truncated += cut
            elif piece:  # the template's own text: its control tokens are control tokens
                ids += self._tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids, truncated


class ToolEnvironment(Environment):
    """Tools as Python functions, the calls written as the policy's chat template says (``environments/tools.py``).

    Args:
        tools: The tools: ``module.function`` paths, or the functions. Each needs named arguments (no ``*args``,
            ``**kwargs`` or positional-only ones: calls pass them by name), type hints and a docstring with an
            ``Args:`` line per argument (its schema, which the chat template shows, is made from them).
        tool_parser: How a turn's calls are read: one of vLLM's tool parsers by name (``hermes`` for Qwen2.5 and
            Hermes-format templates such as ``configs/templates/chatml_tools.jinja``, ``llama3_json``, ...), or
            ``response_template`` (the tokenizer's own).
        max_turns: Policy turns per episode; an episode still calling tools at the last is cut.
        max_tool_calls: Calls per episode; those past it are answered with an error saying so.
        timeout_s: Longest a call may take; a slower one is answered with an error.
        max_reply_tokens: Longest result in tokens (a longer one is cut, and counted).
    """

    whole_turns = True

    def __init__(
        self,
        tools: Sequence[str | Callable],
        tool_parser: str = "hermes",
        max_turns: int = 4,
        max_tool_calls: int = 8,
        timeout_s: float = 10.0,
        max_reply_tokens: int = 256,
    ) -> None:
        super().__init__(max_turns=max_turns, max_reply_tokens=max_reply_tokens)
        errors: list[str] = []
        check_number(errors, "data.environment.init_args.max_tool_calls", max_tool_calls, ge=1)
        check_number(errors, "data.environment.init_args.timeout_s", timeout_s, gt=0)
        if not tools:
            errors.append("data.tools: give at least one tool (module.function)")
        raise_errors(errors)
        functions = [load_tool(tool) for tool in tools]
        self.schemas = [tool_schema(function) for function in functions]
        self.functions = {schema["function"]["name"]: f for schema, f in zip(self.schemas, functions)}
        self._schema_of = {schema["function"]["name"]: schema for schema in self.schemas}
        if len(self.functions) < len(functions):
            raise ValueError("data.tools: two tools have the same name")
        self.tool_parser, self.max_tool_calls, self.timeout_s = tool_parser, max_tool_calls, timeout_s
        self._parser: ToolCallParser | None = None
        self._tokenizer = None
        self._replies: ToolReplies | None = None  # the template's text between two turns, read at prepare
        self._max_chars = 0  # a result's characters kept on its thread (``reply_char_bound``), set at prepare

    @override
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self.schemas)

    @override
    def prepare(self, tokenizer, chat) -> None:
        """Read the chat template once: where the results go between two turns; the parser for the turns.

        Raises:
            ValueError: The template cannot show a tool's result, or shows no tools (``ignores_tools``).
        """
        self._tokenizer, self._max_chars = tokenizer, reply_char_bound(tokenizer, self.max_reply_tokens)
        self._replies = ToolReplies(tokenizer, chat, next(iter(self.functions)), self.max_reply_tokens)
        refuse_hidden_tools(tokenizer, chat, self.schemas, "data.tools")
        self._parser = ToolCallParser(self.tool_parser, tokenizer, self.schemas)

    @override
    def reset(self, prompt: Prompt) -> None:
        return None  # an episode's calls so far are the episode's own count (``answer``'s calls before a turn)

    def read(self, token_ids: list[int]) -> ParsedTurn:
        """A policy turn's calls (its end-of-turn token left out of the text the parser reads)."""
        text = self._tokenizer.decode(token_ids, skip_special_tokens=False)
        eos = self._tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        return self._parser.parse(text)

    def answer(self, turns: Sequence[tuple[ParsedTurn, list[int], int]]) -> list[TurnReply]:
        """The replies to a turn of several episodes: their calls run together, then the results rendered.

        ``turns``: per episode, the turn as read, its token ids, and the episode's calls before it (``max_tool_calls``
        counts them). The calls of every episode run at once under one ``timeout_s`` (``tool_runs.py``); each
        result is cut to what the policy reads of it before an episode keeps it; one that is no Unicode (a lone
        surrogate) is an error.
        """
        slots = [self._checked(turn, calls_made) for turn, _, calls_made in turns]
        to_run = [slot for episode in slots for slot in episode if isinstance(slot, ToolCall)]
        runs = [(call.name, self.functions[call.name], call.arguments) for call in to_run]
        results = iter(run_together(runs, self.timeout_s, self._max_chars))
        replies = []
        for (turn, token_ids, _), episode in zip(turns, slots):
            records = [self._record(slot, next(results)) if isinstance(slot, ToolCall) else slot for slot in episode]
            ids, truncated = self._replies.tokens([record.result for record in records], token_ids)
            messages = [{"role": "tool", "name": r.name, "content": r.result} for r in records]
            replies.append(TurnReply(ids, records, messages, turn.malformed is not None, truncated))
        return replies

    def _checked(self, turn: ParsedTurn, calls_made: int) -> list[CallRecord | ToolCall]:
        """The turn's calls in order: each one to run, or the error record of one that cannot run.

        A malformed call, one past ``max_tool_calls``, an unknown tool, arguments that break the tool's schema.
        """
        slots: list[CallRecord | ToolCall] = []
        if turn.malformed:
            slots.append(CallRecord("", "", f"error: malformed tool call: {turn.malformed}", True, 0.0))
        for number, call in enumerate(turn.calls, start=calls_made + 1):
            why = self._refusal(call, number)
            arguments = call.arguments if call.arguments is not None else call.raw_arguments
            slots.append(call if why is None else CallRecord(call.name, arguments, why, True, 0.0))
        return slots

    def _refusal(self, call: ToolCall, number: int) -> str | None:
        """Why the episode's call ``number`` cannot run, as the policy reads it; ``None``: it runs."""
        if number > self.max_tool_calls:
            return f"error: this episode's {self.max_tool_calls} tool calls are spent (max_tool_calls); answer now"
        if call.name not in self.functions:
            return f"error: there is no tool {call.name!r}; the tools are {', '.join(self.functions)}"
        if call.arguments is None:
            return f"error: the arguments of {call.name} must be a JSON object, got {call.raw_arguments[:80]}"
        problem = argument_problem(self._schema_of[call.name], call.arguments)
        return f"error: {call.name}: {problem}" if problem else None

    def _record(self, call: ToolCall, result: CallResult) -> CallRecord:
        """A call that ran, its result cut to the prefix the policy's tokens are read from (``kept_result``)."""
        text, unreadable = kept_result(self._tokenizer, call.name, result.text, self.max_reply_tokens)
        return CallRecord(call.name, call.arguments, text, result.error or unreadable, result.seconds)
