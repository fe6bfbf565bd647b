r"""Multi-turn rollouts: the policy calls a tool, the tool's reply is written into the completion, the policy goes on.

An episode is one completion that holds several turns::

    prompt | policy: "... <calc>12*7</calc>" | tool: "<result>84</result>" | policy: "... so \boxed{84}" <eos>

Each policy turn is sampled until it ends the tool call (one of the environment's ``stop`` strings), stops, or
reaches ``data.sampling.max_new_tokens``; the environment reads the turn and either replies (its text is tokenised
and appended) or ends the episode. The reply's tokens are context for the policy's next turn but not the policy's
own: they are masked out of the loss (``Completion.loss_mask``), the log-prob ratios and the engine/trainer mismatch.
The group, the rewards and the AMIR pairs work on whole episodes, as on single-turn completions: the rewards see the
episode's text, tool replies included (as TRL passes tool messages to reward functions).

The turns of all episodes are sampled together: the first from each prompt with ``n = group_size``, each later one
from every unfinished episode's text so far with ``n = 1``, each call with a seed of its own.

A tool's faults are outcomes of episodes, counted per rollout, or bugs that stop the run (``environments/replies.py``);
an episode still calling the tool at ``max_turns``, or out of context room, is cut, counted in
``tools/cut_frac``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion, Episode, RolloutEngine, SamplingConfig, turn_seed
from amir_lightning.environments.replies import (
    EnvironmentStepError,
    ToolError,
    call_environment,
    encode_reply,
    say_once,
    step_reply,
)
from amir_lightning.helpers.validation import check_number, raise_errors

__all__ = ["EpisodeBatch", "Environment", "EnvironmentStepError", "EpisodeRecord", "ToolError", "run_episodes"]

#: One turn of sampling: ``(token ids, n, sampling, turn index) -> n completions per input``, seeded by the index.


class Environment(ABC):
    """What the policy talks to in a multi-turn rollout (``data.environment``): a tool, a game, a checker.

    Subclasses implement ``reset`` (an episode's state from its prompt) and ``step`` (the reply to one policy turn,
    or ``None`` to end the episode; ``raise ToolError(reply)`` for a call the tool cannot serve): a text protocol of
    the environment's own, its turn ending at a ``stop`` string. ``ToolEnvironment`` (``environments/tools.py``) instead
    reads whole turns as the chat template writes tool calls, and replies with ``tool`` messages.

    Args:
        max_turns: Policy turns per episode; the episode ends after the last whatever it asks.
        stop: Strings that end a policy turn so the environment can reply (a tool call's closing tag).
        max_reply_tokens: Longest tool reply in tokens (a longer one is cut, and counted).
        on_step_error: What any other exception raised in ``step`` does: ``stop`` the run (it is a bug), or become
            the ``reply`` ``error: <type>: <message>`` (counted as a tool error, reported once).
    """

    #: Whether a turn runs to the policy's end-of-turn token and is read as chat-template tool calls
    #: (``read`` and ``answer``), instead of ending at a ``stop`` string and going to ``step``.
    whole_turns: bool = False

    def __init__(
        self, max_turns: int = 4, stop: list[str] | None = None, max_reply_tokens: int = 64, on_step_error: str = "stop"
    ) -> None:
        errors: list[str] = []
        check_number(errors, "data.environment.init_args.max_turns", max_turns, ge=1)
        check_number(errors, "data.environment.init_args.max_reply_tokens", max_reply_tokens, ge=1)
        if on_step_error not in ("stop", "reply"):
            errors.append(f"data.environment.init_args.on_step_error must be 'stop' or 'reply', got {on_step_error!r}")
        raise_errors(errors)
        self.max_turns, self.stop, self.max_reply_tokens = max_turns, list(stop or []), max_reply_tokens
        self.on_step_error = on_step_error

    @abstractmethod
    def reset(self, prompt: Prompt) -> Any:
        """A new episode's state for ``prompt``."""

    def step(self, state: Any, message: str) -> str | None:
        """The reply to the policy's turn ``message`` (appended to the completion), or ``None``: the episode ends.

        ``message`` is the turn's text up to the end of the stop string that ended it, even when the turn's last
        token wrote past it. Every text-protocol environment implements it.

        Raises:
            ToolError: The tool cannot serve the call; the error's message is the reply.
        """
        raise NotImplementedError(f"{type(self).__name__} replies to whole turns (whole_turns), not to step")

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas the chat template shows the policy (``apply_chat_template(tools=...)``)."""
        return None

    def prepare(self, tokenizer, chat) -> None:  # noqa: B027 (optional hook: text protocols need nothing)
        """Learn the policy's tokenizer and chat format (``data/templates.py``) before the first episode."""

    def episodes(self, batch: EpisodeBatch) -> list[list[Completion]]:
        """``batch.n`` episodes per prompt, in prompt order: ``run_episodes``, this environment replying to each turn.

        An environment that runs its episodes itself (``VerifiersEnvironment``) overrides this; ``batch.engine``
        samples every turn, turn ``i`` from ``turn_seed(batch.seed, i)``, so each stays the engine's and seeded by
        its place in the run.
        """
        return run_episodes(self, batch)

    def close(self) -> None:  # noqa: B027 (optional hook: most environments hold nothing)
        """Release what the environment holds (servers, threads); called when the run ends."""


@dataclass
class EpisodeRecord(Episode):
    """One episode as it grows: the ``Episode`` it becomes, its tokens and the environment's state.

    Its loss mask and counts are the ``Episode``'s; its tokens are the policy's with their log-probs, the replies
    masked.
    """

    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    prompt_index: int = field(default=0, kw_only=True)
    state: Any = field(default=None, kw_only=True)
    token_ids: list[int] = field(default_factory=list, kw_only=True)
    sampling_logps: list[float] = field(default_factory=list, kw_only=True)
    finish_reason: str = field(default="stop", kw_only=True)
    done: bool = field(default=False, kw_only=True)

    def completion(self, tokenizer) -> Completion:
        """The episode as one completion (its text decoded from every token, replies included)."""
        text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        episode = Episode(**{f.name: getattr(self, f.name) for f in fields(Episode)})
        return Completion(self.token_ids, text, self.sampling_logps, self.finish_reason, episode=episode)

    def add(self, token_ids: list[int], sampling_logps: list[float] | None = None) -> None:
        """Append the policy's tokens (with their log-probs), or, without log-probs, a reply's: masked out."""
        self.token_ids += token_ids
        self.sampling_logps += sampling_logps if sampling_logps is not None else [0.0] * len(token_ids)
        self.loss_mask += [int(sampling_logps is not None)] * len(token_ids)  # a reply is context, never trained on


@dataclass(frozen=True)
class EpisodeBatch:
    """The episodes to play: ``n`` per prompt, every turn sampled by ``engine``.

    Attributes:
        prompts: The prompts (``Environment.reset`` gets each).
        prompt_ids: Their token ids.
        n: Episodes per prompt (the group size).
        sampling: Sampling of each policy turn; the environment's ``stop`` strings are added to its own.
        engine: Samples every policy turn (``RolloutEngine.generate``).
        seed: The generation's seed; turn ``i`` is sampled from ``turn_seed(seed, i)``.
        tokenizer: Encodes the replies and decodes the turns.
        room: Longest prompt + episode in tokens (the engine's ``max_model_len``); an episode that would not fit its
            next turn ends as truncated.
    """

    prompts: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]
    n: int
    sampling: SamplingConfig
    engine: RolloutEngine
    seed: int | None
    tokenizer: Any
    room: int | None = None


def run_episodes(environment: Environment, batch: EpisodeBatch) -> list[list[Completion]]:
    """``batch.n`` episodes per prompt, in prompt order, as completions whose tool replies are masked out of the loss.

    ``environment`` replies to the policy's turns.

    Returns:
        ``n`` completions per prompt, each counting its tool's replies, errors, cut replies and whether it was cut.

    Raises:
        EnvironmentStepError: ``reset`` or ``step`` raised (other than ``ToolError``, unless ``on_step_error`` is
            ``reply``).
        ValueError: ``step`` returned something other than a string or ``None``.
    """
    prompts, prompt_ids, n, engine = batch.prompts, batch.prompt_ids, batch.n, batch.engine
    seed, tokenizer, room = batch.seed, batch.tokenizer, batch.room
    turn_sampling = replace(batch.sampling, stop=[*(batch.sampling.stop or []), *environment.stop] or None)
    states = [call_environment(environment, "reset", prompt) for prompt in prompts]
    episodes = [EpisodeRecord(prompt_index=i, state=states[i]) for i in range(len(prompts)) for _ in range(n)]
    if environment.whole_turns:
        for e in episodes:
            e.messages, e.calls = [], []
    for turn in range(environment.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        if turn == 0:
            sampled = [c for group in engine.generate(list(prompt_ids), n, turn_sampling, seed) for c in group]
        else:
            inputs = [list(prompt_ids[e.prompt_index]) + e.token_ids for e in active]
            sampled = [group[0] for group in engine.generate(inputs, 1, turn_sampling, turn_seed(seed, turn))]
        last = turn == environment.max_turns - 1
        for episode, completion in zip(active, sampled):
            episode.turns += 1
            episode.finish_reason = completion.finish_reason
            if not environment.whole_turns:
                _take_turn(environment, episode, completion, tokenizer, last)
        if environment.whole_turns:  # every episode's calls of the turn run together
            _take_whole_turns(environment, active, sampled, last)
        for episode in active:
            used = len(prompt_ids[episode.prompt_index]) + len(episode.token_ids)
            if not episode.done and room is not None and used + turn_sampling.max_new_tokens > room:
                # No room for another turn: cut, as a long completion is.
                episode.done, episode.finish_reason, episode.tool_cut = True, "length", True
    out: list[list[Completion]] = [[] for _ in prompts]
    for e in episodes:
        out[e.prompt_index].append(e.completion(tokenizer))
    return out


def _take_turn(environment: Environment, episode: EpisodeRecord, completion: Completion, tokenizer, last: bool) -> None:
    """Add the policy's turn to ``episode``, then the environment's reply, or end it (a text protocol)."""
    episode.add(completion.token_ids, completion.sampling_logps)
    message, overshoot = _turn_text(completion, environment.stop, tokenizer)
    # A turn that stopped on anything but the environment's own stop strings (an EOS token, data.sampling.stop) is
    # the policy's last word; so is one cut by the length limit, and the last turn allowed.
    if overshoot is None or last:
        episode.done = True
        episode.tool_cut = overshoot is not None  # the last turn allowed asked the tool: the episode is cut
        return
    reply, error = step_reply(environment, episode.state, message)
    episode.tool_errors += error
    if reply is None:
        episode.done = True
        return
    if overshoot and reply.startswith(overshoot):
        reply = reply[len(overshoot) :]  # the policy already wrote the reply's first characters ("</calc><")
    reply_ids, cut, unreadable = _reply_tokens(environment, reply, tokenizer)
    episode.tool_errors += unreadable and not error
    if cut:
        episode.tool_truncated += 1
        said = f"a reply of {len(reply)} characters was cut to {environment.max_reply_tokens} tokens (max_reply_tokens)"
        say_once(environment, "truncated", said + "; counted in tools/reply_truncated_frac")
    episode.add(reply_ids)  # not sampled: masked out of every ratio
    episode.tool_calls += 1


def _reply_tokens(environment: Environment, reply: str, tokenizer) -> tuple[list[int], bool, bool]:
    """The reply's tokens (``encode_reply``), whether cut, and whether it was no Unicode: then an error reply."""
    try:
        return (*encode_reply(tokenizer, reply, environment.max_reply_tokens), False)
    except UnicodeEncodeError as err:  # a lone surrogate: no tokenizer reads it; the policy reads why, counted
        why = f"not valid Unicode ({err.reason} at character {err.start})"
        say_once(environment, "unicode", f"step replied text that is {why}; the policy reads an error, counted in "
                                         "tools/error_frac")  # fmt: skip
        return (*encode_reply(tokenizer, f"error: the reply is {why}", environment.max_reply_tokens), True)


def _take_whole_turns(environment, episodes: list[EpisodeRecord], completions: list[Completion], last: bool) -> None:
    """Add each policy turn to its episode; run the tool calls they wrote, all together, and add their results.

    An episode whose turn calls nothing (its answer), or whose call was cut or came at the last turn allowed, ends.
    """
    asking = []
    for episode, completion in zip(episodes, completions):
        turn = _read_whole_turn(environment, episode, completion, last)
        if turn is not None:
            calls_made = len(episode.calls) - episode.tool_malformed  # the records of malformed turns are not calls
            asking.append((episode, (turn, completion.token_ids, calls_made)))
    replies = environment.answer([request for _, request in asking])
    for (episode, _), reply in zip(asking, replies):
        _add_reply(environment, episode, reply)


def _read_whole_turn(environment, episode: EpisodeRecord, completion: Completion, last: bool):
    """Add the policy's turn to ``episode`` and read it: the turn when it asks for calls to run, else ``None``."""
    episode.add(completion.token_ids, completion.sampling_logps)
    turn = environment.read(completion.token_ids)
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.calls:  # the text before the calls, without the line break the template writes between them
        message["content"] = turn.content.strip()
        message["tool_calls"] = [call.message() for call in turn.calls]
    episode.messages.append(message)
    if not turn.calls and not turn.malformed:  # the policy's answer
        episode.done = True
        return None
    # A call cut by the length limit never runs, nor one at the last turn allowed: the episode is cut.
    if completion.finish_reason != "stop" or last:
        episode.done, episode.tool_cut = True, True
        return None
    return turn


def _add_reply(environment, episode: EpisodeRecord, reply) -> None:
    """Add a turn's results (``TurnReply``) to ``episode``: its tokens, masked; its messages and calls, counted."""
    episode.add(reply.token_ids)
    episode.messages += reply.messages
    episode.calls += [record.as_dict() for record in reply.calls]
    episode.tool_calls += len(reply.calls)
    episode.tool_errors += sum(record.error for record in reply.calls)
    episode.tool_malformed += reply.malformed
    episode.tool_truncated += reply.truncated
    episode.tool_seconds += sum(record.seconds for record in reply.calls)
    if reply.truncated:
        said = f"a result was cut to {environment.max_reply_tokens} tokens (max_reply_tokens)"
        say_once(environment, "truncated", said + "; counted in tools/reply_truncated_frac")


def _turn_text(completion: Completion, stop: Sequence[str], tokenizer) -> tuple[str, str | None]:
    """A policy turn's text up to the end of the environment's stop string, and what its last token wrote past it.

    The overshoot is ``None`` when the turn did not end on one of the ``stop`` strings. Engines stop at the token
    that completes a stop string, and a token can hold more than the string: a tokenizer that merges ``"><"``
    ends ``<calc>84*42</calc><result>`` with the token ``"><"``, so the turn reads ``...</calc><``.
    """
    ids = completion.token_ids
    message = tokenizer.decode(ids, skip_special_tokens=True)
    if completion.finish_reason != "stop" or not ids:
        return message, None
    before = tokenizer.decode(ids[:-1], skip_special_tokens=True)
    ends = [message.find(s) + len(s) for s in stop if s in message and s not in before]
    if not ends:
        return message, None
    end = min(ends)
    return message[:end], message[end:]
