"""PromptStream: the training prompt order, a cursor that checkpoints resume from, and per-pass shuffling."""

from __future__ import annotations

import random

from amir_lightning.data.base import Prompt, PromptSource

#: Multiplier (Knuth's multiplicative hash) that spreads the seeds' starting places over a random source's indices.
_SPREAD = 2_654_435_761


class PromptStream:
    """Serves prompts from ``source`` in order; a finite source is reshuffled (seeded) on every pass over it.

    A random source (``is_random``: every index is already a fresh draw) is not shuffled; with ``shuffle`` on, the
    seed picks where in its index space the stream starts (seed 0: at index 0), so runs of different seeds train
    on different prompts. With ``shuffle`` off it is served from index 0 whatever the seed.

    The position is the only state: it is saved in checkpoints, so a resumed run continues with the next prompt.
    """

    def __init__(self, source: PromptSource, shuffle: bool = True, seed: int = 0) -> None:
        self.source, self.shuffle, self.seed = source, shuffle, seed
        self.position = 0
        self._order: tuple[int, list[int]] = (-1, [])
        self._kept: list[int] | None = None  # the source's indices served; None: all of them

    def exclude(self, indices: set[int]) -> None:
        """Never serve these indices of the source (prompts that cannot be trained on); the rest keep their order."""
        self._kept = [i for i in range(len(self.source)) if i not in indices] if indices else None
        self._order = (-1, [])

    def __len__(self) -> int:
        """Prompts served per pass."""
        return len(self.source) if self._kept is None else len(self._kept)

    def _source_at(self, index: int) -> Prompt:
        return self.source[index if self._kept is None else self._kept[index]]

    def _at(self, position: int) -> Prompt:
        size = len(self)
        if not self.shuffle:
            return self._source_at(position % size)
        if self.source.is_random:
            return self._source_at((position + self.seed * _SPREAD) % size)
        data_epoch, offset = divmod(position, size)
        if self._order[0] != data_epoch:  # a fresh permutation per pass
            order = list(range(size))
            random.Random(self.seed * 7919 + data_epoch).shuffle(order)
            self._order = (data_epoch, order)
        return self._source_at(self._order[1][offset])

    def take(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts (advances the position)."""
        batch = [self._at(self.position + i) for i in range(count)]
        self.position += count
        return batch
