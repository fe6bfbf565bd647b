"""PromptStream: the training prompt order, a cursor that checkpoints resume from, and per-pass shuffling."""

from __future__ import annotations

import random

from amir_lightning.data.base import Prompt, PromptSource


class PromptStream:
    """Serves prompts from ``source`` in order; a finite source is reshuffled (seeded) on every pass over it.

    The position is the only state: it is saved in checkpoints, so a resumed run continues with the next prompt.
    """

    def __init__(self, source: PromptSource, shuffle: bool = True, seed: int = 0) -> None:
        self.source, self.shuffle, self.seed = source, shuffle, seed
        self.position = 0
        self._order: tuple[int, list[int]] = (-1, [])

    def _at(self, position: int) -> Prompt:
        size = len(self.source)
        if not self.shuffle or self.source.is_random:
            return self.source[position % size]
        data_epoch, offset = divmod(position, size)
        if self._order[0] != data_epoch:  # a fresh permutation per pass
            order = list(range(size))
            random.Random(self.seed * 7919 + data_epoch).shuffle(order)
            self._order = (data_epoch, order)
        return self.source[self._order[1][offset]]

    def take(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts (advances the position)."""
        batch = [self._at(self.position + i) for i in range(count)]
        self.position += count
        return batch
