"""A Python function as a tool: loaded from its path, its JSON schema, and what a call of it may pass.

The policy writes a call as a JSON object of named arguments (``environments/tool_calls.py``), so a tool is a function
whose every argument has a name, a type hint and a line of its docstring: ``get_json_schema`` makes its schema from
those, the chat template shows the schema, and a call's arguments are checked against it before the function runs
(``environments/tools.py``).
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from typing import Any

_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def load_tool(tool: str | Callable) -> Callable:
    """A tool given as ``module.function`` (or ``module:function``), or the function itself."""
    if callable(tool):
        return tool
    module, _, name = tool.replace(":", ".").rpartition(".")
    try:
        function = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"data.tools: {tool!r} cannot be imported ({type(err).__name__}: {err})") from None
    if not callable(function):
        raise ValueError(f"data.tools: {tool!r} is not a module.function path of a callable")
    return function


def tool_schema(function: Callable) -> dict[str, Any]:
    """The tool's JSON schema (``get_json_schema``: from its type hints and its docstring's ``Args:``).

    Raises:
        ValueError: The function has no schema, or one its calls could never follow (``signature_problem``).
    """
    from transformers.utils import get_json_schema

    name = getattr(function, "__qualname__", function)
    if problem := signature_problem(function):
        raise ValueError(
            f"data.tools: {name} {problem}: a call passes each argument by name (the JSON object the policy writes), "
            "so it could never be called as its schema says; give every argument a name"
        )
    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - transformers says what is missing; say which tool
        raise ValueError(
            f"data.tools: {name} needs type hints on every argument and a docstring with a description and an Args: "
            f"line per argument ({type(err).__name__}: {err})"
        ) from None


def signature_problem(function: Callable) -> str | None:
    """What in ``function``'s signature no call by keyword can reach, as ``takes *values``; ``None``: nothing.

    The schema makes a required property of ``*values`` and of ``**extra`` alike, and lists positional-only ones:
    ``function(values=3)`` raises, and ``function(extra=...)`` arrives as ``{"extra": ...}``.
    """
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return "has no signature Python can read"
    for parameter in parameters:
        if parameter.kind is parameter.VAR_POSITIONAL:
            return f"takes *{parameter.name}"
        if parameter.kind is parameter.VAR_KEYWORD:
            return f"takes **{parameter.name}"
        if parameter.kind is parameter.POSITIONAL_ONLY:
            return f"takes {parameter.name} by position only"
    return None


def argument_problem(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for the tool of ``schema`` (JSON types, required, unknown); ``None``: fine."""
    parameters = schema["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        takes = ", ".join(properties) or "none"
        return f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (it takes {takes})"
    for name, value in arguments.items():
        spec = properties[name]
        types = spec.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if spec.get("nullable"):
            types.append("null")
        allowed = tuple(t for kind in types for t in _JSON_TYPES.get(kind, (object,)))
        wrong_bool = isinstance(value, bool) and "boolean" not in types  # True is an int to Python, not to JSON
        if allowed and (not isinstance(value, allowed) or wrong_bool):
            return f"argument {name} must be {' or '.join(types)}, got {json.dumps(value)[:80]}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {name} must be one of {', '.join(map(str, spec['enum']))}, got {json.dumps(value)[:80]}"
    return None
