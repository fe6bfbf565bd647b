"""A policy turn's text read as tool calls, by the model's own parser.

Two parsers exist for the formats models write, and both are used as they are:

- vLLM's tool parsers, chosen by name (``hermes`` for Qwen2.5 and the Hermes models, ``llama3_json``,
  ``qwen3_xml``, ``mistral``, ...; ``vllm.tool_parsers.ToolParserManager.list_registered()`` names them all), the
  ones ``vllm serve --tool-call-parser`` uses;
- the tokenizer's response template (transformers' ``parse_response``), where the model ships one
  (``tool_parser: response_template``).

What neither says is written here: whether a turn that yields no call tried to make one (the parser's opening tag is
in the text: a malformed call, which the policy is told about), and whether a call's arguments are a JSON object.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from amir_lightning.helpers.extras import extra_requirements

#: The parser that reads the tokenizer's response template instead of one of vLLM's.
RESPONSE_TEMPLATE = "response_template"


@dataclass
class ToolCall:
    """One call the policy wrote.

    Attributes:
        name: The tool it names.
        arguments: Its arguments, decoded; ``None`` when they were not a JSON object.
        raw_arguments: The arguments as written (for the error the policy reads).
    """

    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str = ""

    def message(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` entry (OpenAI's shape, which chat templates render)."""
        arguments = self.arguments if self.arguments is not None else self.raw_arguments
        return {"type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass
class ParsedTurn:
    """A policy turn as its parser reads it.

    Attributes:
        content: The text beside the calls (before them, for most formats).
        calls: The calls, in the order written (several: parallel calls).
        malformed: Why the turn's attempt at a call could not be read; ``None`` when it made none or all parsed.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    malformed: str | None = None


def _decoded(name: str, arguments: Any) -> ToolCall:
    """A call whose arguments arrive as a JSON string or already decoded."""
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    return ToolCall(str(name), arguments if isinstance(arguments, dict) else None, raw)


class ToolCallParser:
    """Reads tool calls out of a policy turn's text.

    Args:
        name: A vLLM tool parser's name, or ``response_template`` for the tokenizer's own.
        tokenizer: The policy's tokenizer.
        schemas: The tools' JSON schemas (some parsers read the argument types from them).
    """

    def __init__(self, name: str, tokenizer, schemas: list[dict[str, Any]]) -> None:
        self.name, self.tokenizer, self.schemas = name, tokenizer, schemas
        if name == RESPONSE_TEMPLATE:
            if getattr(tokenizer, "response_template", None) is None:
                raise ValueError(
                    f"data.environment.init_args.tool_parser {RESPONSE_TEMPLATE}: the tokenizer of "
                    f"{getattr(tokenizer, 'name_or_path', 'the policy')} has no response template; name one of "
                    "vLLM's tool parsers instead (hermes for Qwen2.5 and Hermes-format templates)"
                )
            self.opening = None
            return
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.tool_parsers import ToolParserManager
        except ImportError as err:
            raise ModuleNotFoundError(
                f"data.environment.init_args.tool_parser {name} is one of vLLM's tool parsers: pip install "
                f"'{extra_requirements('cpu')[0]}' (CPU) or '{extra_requirements('gpu')[0]}' (GPU), or use "
                f"tool_parser {RESPONSE_TEMPLATE} with a tokenizer that has one"
            ) from err
        try:
            parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(ToolParserManager.list_registered())
            raise ValueError(f"data.environment.init_args.tool_parser {name!r} is not one of vLLM's: {known}") from None
        self._request = ChatCompletionRequest(
            model="policy", messages=[{"role": "user", "content": ""}], tools=schemas or None
        )
        self._parser = parser_class(tokenizer, self._request.tools)
        self._logger = logging.getLogger(parser_class.__module__)
        #: Text that opens a call in this format (``<tool_call>``); ``None`` where the format has no marker.
        self.opening = getattr(self._parser, "tool_call_start_token", None)

    def parse(self, text: str) -> ParsedTurn:
        """The turn's calls and the text beside them; a call that does not parse makes the turn ``malformed``."""
        if self.name == RESPONSE_TEMPLATE:
            return self._parse_with_template(text)
        level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)  # a malformed call is an outcome of the episode, not a log traceback
        try:
            info = self._parser.extract_tool_calls(text, self._request)
        except Exception as err:  # noqa: BLE001 - a parser that fails on the policy's text: the call is malformed
            return ParsedTurn(text, [], f"the call could not be parsed ({type(err).__name__}: {err})")
        finally:
            self._logger.setLevel(level)
        if not info.tools_called:
            if self.opening and self.opening in text:
                return ParsedTurn(text, [], f"a call opened with {self.opening} could not be parsed")
            return ParsedTurn(text)
        calls = [_decoded(call.function.name, call.function.arguments) for call in info.tool_calls]
        return ParsedTurn(info.content or "", calls)

    def _parse_with_template(self, text: str) -> ParsedTurn:
        try:
            message = self.tokenizer.parse_response(text, prefix="", tools=self.schemas)
        except Exception as err:  # noqa: BLE001 - the policy's text does not fit the template: malformed
            return ParsedTurn(text, [], f"the turn does not parse ({type(err).__name__}: {err})")
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            calls.append(_decoded(function.get("name", ""), function.get("arguments", {})))
        content = message.get("content") or ""
        return ParsedTurn(content if isinstance(content, str) else str(content), calls)
