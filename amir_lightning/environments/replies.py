"""What an environment's replies become in an episode (``environments/base.py``), and what its faults do.

A tool's faults are outcomes of episodes, counted per rollout (``tool_metrics``), or bugs that stop the run:

- a ``ToolError`` raised in ``step`` (the tool failed on the policy's input, as the calculator on ``9**9**9``) is the
  reply, counted in ``tools/error_frac``;
- any other exception in ``reset`` or ``step`` is a bug: the run stops with its traceback and one line naming the
  class and ``data.environment`` (exit 1), unless the environment has ``on_step_error="reply"``;
- a reply that is not a string (or ``None``) stops the run naming what it was (exit 2);
- a reply is tokenised as text, cut at ``max_reply_tokens`` and counted in ``tools/reply_truncated_frac``;
- a reply that is not valid Unicode (a lone surrogate, which no tokenizer reads) becomes an error reply saying where,
  counted in ``tools/error_frac``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from amir_lightning.engines.base import Completion

log = logging.getLogger(__name__)

#: Characters tokenised first per reply token allowed: a longer reply is tokenised from a prefix (grown while short).
_CHARS_PER_TOKEN = 16


class ToolError(Exception):
    """Raised in ``Environment.step`` when the tool fails on the policy's call; the message is the reply it reads.

    An outcome of the episode, not an error of the run: counted in ``tools/error_frac``.
    """


class EnvironmentStepError(RuntimeError):
    """An environment's ``reset`` or ``step`` raised (a bug in it); ``__cause__`` holds the exception."""


def step_reply(environment: Any, state: Any, message: str) -> tuple[str | None, bool]:
    """``environment.step(state, message)``, checked: the reply (``None``: the episode ends) and whether it is an error.

    Raises:
        EnvironmentStepError: ``step`` raised something other than ``ToolError`` and the environment's
            ``on_step_error`` is ``stop``.
        ValueError: ``step`` returned something other than a string or ``None``.
    """
    try:
        reply = environment.step(state, message)
    except ToolError as err:
        return str(err), True
    except Exception as err:
        if getattr(environment, "on_step_error", "stop") != "reply":
            raise _step_error(environment, "step", err) from err
        said = f"step raised {type(err).__name__}: {err}; the reply is the error (on_step_error: reply)"
        say_once(environment, type(err).__name__, said + "; counted in tools/error_frac")
        return f"error: {type(err).__name__}: {err}", True
    if reply is not None and not isinstance(reply, str):
        raise ValueError(
            f"data.environment: {type(environment).__name__}.step returned {reply!r:.80} ({type(reply).__name__}): "
            "expected the reply as a str, or None to end the episode"
        )
    return reply, False


def call_environment(environment: Any, method: str, *args: Any) -> Any:
    """``environment.<method>(*args)``; an exception becomes an ``EnvironmentStepError`` naming the environment."""
    try:
        return getattr(environment, method)(*args)
    except Exception as err:
        raise _step_error(environment, method, err) from err


def _step_error(environment: Any, method: str, err: Exception) -> EnvironmentStepError:
    hint = " (raise amir_lightning.environments.ToolError for a call the policy should read as an error)"
    return EnvironmentStepError(
        f"data.environment: {type(environment).__name__}.{method} raised {type(err).__name__}: {err}"
        + (hint if method == "step" else "")
    )


def encode_reply(tokenizer, reply: str, limit: int) -> tuple[list[int], bool]:
    """The first ``limit`` token ids of ``reply``, tokenised as text, and whether it had more.

    Special-token text is split into ordinary tokens (``split_special_tokens``): a reply holding ``<|im_end|>``
    cannot write the chat template's control token, so a tool cannot end the policy's turn or open a user's. Only a
    prefix is tokenised, grown until it holds more than ``limit`` tokens, so a megabyte reply costs about what a
    ``limit``-token one does.

    Raises:
        UnicodeEncodeError: The prefix read is not Unicode a tokenizer can read (a lone surrogate, ``"\ud800"``).
    """
    _, ids = _read_prefix(tokenizer, reply, limit)
    return ids[:limit], len(ids) > limit


def kept_reply(tokenizer, reply: str, limit: int) -> str:
    """What to keep of ``reply``: the prefix ``encode_reply`` reads its tokens from (all of it when it is short).

    ``encode_reply`` of the prefix gives the same tokens, and says it was cut, as of the whole reply: what an episode
    keeps of a tool's result (its messages, its calls) is what the policy read, a few times ``limit`` tokens of text
    however long the result was.

    Raises:
        UnicodeEncodeError: As ``encode_reply``.
    """
    return _read_prefix(tokenizer, reply, limit)[0]


def kept_result(tokenizer, tool: str, result: str, limit: int) -> tuple[str, bool]:
    """What an episode keeps of ``tool``'s ``result`` (``kept_reply``), and whether that is an error instead.

    A result that is not valid Unicode (a lone surrogate, which no tokenizer reads) is kept as an error the policy
    reads, naming the tool and where; it counts in ``tools/error_frac``.
    """
    try:
        return kept_reply(tokenizer, result, limit), False
    except UnicodeEncodeError as err:
        return f"error: the result of {tool} is not valid Unicode ({err.reason} at character {err.start})", True


def reply_char_bound(tokenizer, limit: int) -> int:
    """Characters of a reply that hold all ``kept_reply`` keeps of it: a reply may be cut there first, untokenised.

    No token covers more characters than its vocabulary entry has (a byte-level entry is one character a byte), so
    this many characters hold four times the ``limit + 2`` tokens ``encode_reply`` reads, or the whole reply; the
    factor is room for normalisers that compose characters. A normaliser that deletes characters (control
    characters, accents) can need more; none of the chat models' tokenizers has one.
    """
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return 4 * (limit + 2) * max(longest, _CHARS_PER_TOKEN)


def _read_prefix(tokenizer, reply: str, limit: int) -> tuple[str, list[int]]:
    """The prefix of ``reply`` whose tokens hold the reply's first ``limit`` and one more, and those tokens.

    A prefix of ``_CHARS_PER_TOKEN`` characters a token allowed, grown four times while it holds too few; past the
    cut, the prefix's tokens are the reply's.
    """
    chars = _CHARS_PER_TOKEN * (limit + 2)
    while True:
        prefix = reply[:chars]
        prefix.encode("utf-8")  # a lone surrogate raises here, naming its place, not deep in the tokenizer
        ids = tokenizer(prefix, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if chars >= len(reply) or len(ids) > limit + 1:
            return prefix, ids
        chars *= 4


_SAID: set[tuple[str, str]] = set()


def say_once(environment: Any, kind: str, message: str) -> None:
    """Log ``message`` the first time ``environment``'s class has this ``kind`` of outcome in this process."""
    key = (type(environment).__name__, kind)
    if key not in _SAID:
        _SAID.add(key)
        log.warning("data.environment %s: %s", key[0], message)


def tool_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """A rollout's tool use (empty without episodes), per episode and as shares.

    Turns, calls, tool seconds and reply tokens per episode; the shares of episodes with a call and of episodes cut
    while calling; of calls that were errors or whose reply was cut at ``max_reply_tokens``; of policy turns whose
    call did not parse; and of the episodes' tokens that are tool output (context, not trained on).
    """
    lengths = [(len(c.token_ids), c.policy_tokens) for c in completions if c.episode is not None]
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    count, calls = len(episodes), max(sum(c.tool_calls for c in episodes), 1)
    reply_tokens = sum(length - own for length, own in lengths)
    return {
        "tools/turns": sum(c.turns for c in episodes) / count,
        "tools/calls": sum(c.tool_calls for c in episodes) / count,
        "tools/call_frac": sum(c.tool_calls > 0 for c in episodes) / count,
        "tools/seconds": sum(c.tool_seconds for c in episodes) / count,
        "tools/reply_tokens": reply_tokens / count,
        "tools/token_frac": reply_tokens / max(sum(length for length, _ in lengths), 1),
        "tools/error_frac": sum(c.tool_errors for c in episodes) / calls,
        "tools/reply_truncated_frac": sum(c.tool_truncated for c in episodes) / calls,
        "tools/malformed_frac": sum(c.tool_malformed for c in episodes) / max(sum(c.turns for c in episodes), 1),
        "tools/cut_frac": sum(c.tool_cut for c in episodes) / count,
    }
