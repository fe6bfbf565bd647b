"""Tools as Python functions for ``tests/test_tools.py`` and the tiny tool runs (``data.tools: [tool_functions.add]``).

Each is typed and documented, as ``transformers.utils.get_json_schema`` needs.
"""

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def slow(seconds: float) -> str:
    """Wait, then say so (a tool that hangs).

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "done"


def shout(text: str) -> str:
    """The text, repeated (a result as long as asked, or holding whatever text it is given).

    Args:
        text: What to repeat.
    """
    return text


def wander(path: str) -> str:
    """Change the working directory (a tool that changes the process's state).

    Args:
        path: Where to go.
    """
    os.chdir(path)
    return "moved"


def lookup(key: str) -> dict:
    """A record as JSON.

    Args:
        key: The record's key.
    """
    return {"key": key, "value": len(key)}


def sees_conversations(completions, tool_calls, **kwargs):
    """A reward (TRL's signature) that checks what rewards get in episodes of tool calls: each completion as its
    messages, and the calls it made; it scores the number of its policy turns."""
    assert all(isinstance(c, list) and c and c[0]["role"] == "assistant" for c in completions), completions[:1]
    assert len(tool_calls) == len(completions) and all(isinstance(calls, list) for calls in tool_calls)
    return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]


def total(*values: int) -> int:
    """The sum of the numbers (a signature no call by name can reach: ``total(values=...)`` raises).

    Args:
        values: The numbers.
    """
    return sum(values)


def first(a: int, /, b: int) -> int:
    """The first argument (positional only: ``first(a=1, b=2)`` raises).

    Args:
        a: The first.
        b: The second.
    """
    return a


def options(name: str, **extra: str) -> str:
    """The options given (the schema asks for an argument named ``extra``, which arrives as ``{"extra": ...}``).

    Args:
        name: A name.
        extra: More options.
    """
    return name


def garbled() -> str:
    """Text with a lone surrogate, which is no Unicode a tokenizer reads (a tool decoding bytes with
    ``surrogateescape``)."""
    return "ok \ud800 ok"


def dump(megabytes: int) -> str:
    """Words, as many megabytes of them as asked (a tool that prints a whole file).

    Args:
        megabytes: How many.
    """
    return "the quick brown fox jumps over the lazy dog " * (megabytes * 2**20 // 44)
