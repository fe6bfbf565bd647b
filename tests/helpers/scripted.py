"""A scripted policy as an engine: the episode tests' turns, given by a function of the turn, through the engine seam.

``Scripted(policy)`` answers each ``generate`` call with ``policy(ids, n, sampling, turn)``, ``turn`` counting the
calls (an episode runner asks once per turn, in order), so a test scripts what the policy writes at each turn while
the environments see a ``RolloutEngine`` as in a run.
"""

from __future__ import annotations

from amir_lightning.engines.base import RolloutEngine


class Scripted(RolloutEngine):
    """An engine whose ``turn``-th generation is ``policy(ids, n, sampling, turn)``; it takes no weights."""

    def __init__(self, policy) -> None:
        self.policy, self.turn, self.seeds = policy, 0, []

    def start(self, model_dir, seed, device=None, local_rank=0, in_flight=False):  # noqa: D102
        self._started = True

    def generate(self, prompts, n, sampling, seed=None):  # noqa: D102
        self.seeds.append(seed)
        turn, self.turn = self.turn, self.turn + 1
        return self.policy([list(p) for p in prompts], n, sampling, turn)

    def load_weights(self, named_tensors, version=0):  # noqa: D102
        raise NotImplementedError("a scripted policy takes no weights")

    def score(self, prompt, completion):  # noqa: D102
        raise NotImplementedError("a scripted policy scores nothing")
