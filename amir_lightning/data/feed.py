"""The training prompts as one process draws them: screened once, drawn in step with every process, chat-templated.

Every process takes the same slice of the prompt stream and keeps its own share, so a group never spans processes
and the stream's position is the same everywhere (a checkpoint saves it once). A finite source is screened before
the engine starts (``data/screening.py``): every process renders the same prompts and leaves out the same ones.

Dynamic sampling's further rounds on a rollout sampled ahead draw from a second stream over the same prompts, in an
order of its own (``draw_refill``): the main stream's next prompts are drawn already, by the rollouts sampling ahead,
and the positions a checkpoint saves of them stay as they were however many rounds a rollout needed.
"""

from __future__ import annotations

import logging

from amir_lightning.data.base import Prompt, PromptSource
from amir_lightning.data.screening import check_references, screen
from amir_lightning.data.stream import PromptStream
from amir_lightning.data.templates import ChatFormat, render_prompts

log = logging.getLogger(__name__)

#: Added to the run's seed for the refill stream's order, always shuffled: never the main stream's order.
REFILL_SEED = 1_000_033


class PromptFeed:
    """Screen, draw for a rank, tokenise; its cursor is the stream's position.

    Args:
        source: The training prompt source (``data.prompts``).
        chat: How a prompt becomes the model's text (system prompt, chat template and its variables).
        prompt_limit: Longest prompt in tokens after the chat template.
        bad_prompts: ``skip`` prompts that cannot be used, or stop with an ``error`` (``data.bad_prompts``).
        shuffle: Shuffle a finite source once per pass (``data.shuffle``).
        seed: The run's seed (the order of a shuffled source).
    """

    def __init__(
        self, source: PromptSource, chat: ChatFormat, prompt_limit: int, bad_prompts: str, shuffle: bool, seed: int
    ) -> None:
        self.source, self.chat, self.prompt_limit, self.bad_prompts = source, chat, prompt_limit, bad_prompts
        self.stream = PromptStream(source, shuffle, seed)
        self.refill_stream = PromptStream(source, True, seed + REFILL_SEED)
        self.skipped = 0  # prompts screening left out (data/skipped_prompts)
        self._screened = False

    @property
    def position(self) -> int:
        """Prompts drawn from the stream so far, by every process together."""
        return self.stream.position

    @position.setter
    def position(self, value: int) -> None:
        self.stream.position = value

    @property
    def refill_position(self) -> int:
        """Prompts drawn from the refill stream so far, by every process together."""
        return self.refill_stream.position

    @refill_position.setter
    def refill_position(self, value: int) -> None:
        self.refill_stream.position = value

    def passes(self, position: int) -> float:
        """Passes over the (screened) prompt set that ``position`` prompts make (TRL's fractional epoch)."""
        return position / max(len(self.stream), 1)

    def draw(self, rank: int, ranks: int, per_rank: int) -> list[Prompt]:
        """This process's ``per_rank`` prompts of the next ``per_rank * ranks`` (every process draws the slice)."""
        return _share(self.stream.take(per_rank * ranks), rank, per_rank)

    def draw_refill(self, rank: int, ranks: int, per_rank: int) -> list[Prompt]:
        """``draw``, from the refill stream (dynamic sampling's further rounds on a rollout sampled ahead)."""
        return _share(self.refill_stream.take(per_rank * ranks), rank, per_rank)

    def tokenize(self, tokenizer, prompts: list[Prompt], where: str | None = None) -> list[list[int]]:
        """Chat-templated token ids; a prompt over ``prompt_limit`` is an error naming it and ``where`` it is from.

        ``where`` defaults to the training source's description (held-out prompts and benchmarks give their own).
        """
        return render_prompts(tokenizer, prompts, self.chat, self.prompt_limit, where or self.source.describe())

    def screen(self, tokenizer, grading_reward, report: bool) -> int:
        """Render every prompt of a finite source once; leave out (or stop on) the ones that cannot be used.

        A random source (a generator) has no end to screen: its prompts are checked as they are drawn. A reward that
        grades against reference answers (``grading_reward``) is refused on a source that has none, naming its
        columns.

        Args:
            tokenizer: The policy's tokenizer.
            grading_reward: The first reward that needs reference answers, or ``None``.
            report: Whether this process logs what it found (the global-zero one).

        Returns:
            How many prompts were left out by this call (0 when screened before, or nothing was wrong).
        """
        source = self.source
        if source.is_random or self._screened:
            return 0
        self._screened = True
        found = screen(source, tokenizer, self.chat, self.prompt_limit, report)
        check_references(source, found.answered, grading_reward)
        if found.lost and report:
            log.warning(
                "%d of %d training prompts have characters the tokenizer cannot encode (dropped, or turned into its "
                "unknown token), the first at %s",
                len(found.lost),
                len(source),
                found.lost[0],
            )
        if not found.bad:
            return 0
        first = ", ".join(list(found.bad.values())[:3])
        limit = (
            f"the limit is {self.prompt_limit} tokens (data.max_prompt_tokens, or max_model_len minus max_new_tokens)"
        )
        if self.bad_prompts == "error" or len(found.bad) == len(source):
            raise ValueError(
                f"{len(found.bad)} of {len(source)} training prompts cannot be used: {first}; {limit}; "
                "data.bad_prompts: skip leaves them out"
            )
        self.stream.exclude(set(found.bad))
        self.refill_stream.exclude(set(found.bad))
        self.skipped = len(found.bad)
        if report:
            log.warning("skipping %d of %d training prompts that cannot be used: %s; %s", len(found.bad), len(source),
                        first, limit)  # fmt: skip
        return self.skipped


def _share(batch: list[Prompt], rank: int, per_rank: int) -> list[Prompt]:
    return batch[rank * per_rank : (rank + 1) * per_rank]
