"""The parts of two gloo processes that tests spawn, in a module that imports only what they need (torch and the
package's parts they call): a spawned process imports the module of its function, and a test file's imports take
about 5 s (lightning, transformers).

- ``refill_rounds``: dynamic sampling's rounds on two ranks (``tests/test_dynamic_sampling.py``), of ``a_round``s.
- ``mean_over``: a metric only one process logged, averaged (``tests/test_reward_logging.py``).
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from helpers.refill import refill

from amir_lightning.data.base import Prompt
from amir_lightning.engines.base import Completion
from amir_lightning.helpers.distributed import all_reduce, mean_over_processes
from amir_lightning.loop.dynamic import Round
from amir_lightning.loop.rewarding import Scores

G = 2


def a_round(name: str, totals: list[list[float]]) -> Round:
    """A scored round of prompts named ``name0``, ``name1``...: group ``i`` has the rewards ``totals[i]``."""
    count = len(totals)
    prompts = [Prompt(f"{name}{i}", "") for i in range(count)]
    completions = [[Completion([i, k], f"{name}{i}.{k}", [0.0, 0.0], "stop") for k in range(G)] for i in range(count)]
    flat = torch.tensor([float(v) for group in totals for v in group])
    scores = Scores(flat, {"rollout/reward_mean": float(flat.nan_to_num().mean())}, torch.full_like(flat, 1.0), 0.5)
    return Round(prompts, [[i] for i in range(len(totals))], completions, scores, 2.0)


def refill_rounds(rank: int, port: int, out: str) -> None:
    """Rank 0's first round is full, rank 1's has no group with variance: both run the same rounds and draw as many
    prompts in each; rank 0 draws its share without sampling it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        first = a_round("a", [[0, 1], [0, 1]] if rank == 0 else [[1, 1], [1, 1]])
        asked = []

        def more(count, index, sample):
            asked.append((count, index, sample))
            return a_round("b", [[1, 1], [0, 3]][:count]) if sample else None

        def max_over(values):
            return all_reduce(torch.tensor(values, dtype=torch.float64), "max").tolist()

        chosen, metrics = refill(first, more, 2, G, 3, max_over)
        Path(f"{out}.{rank}").write_text(repr((asked, [p.question for p in chosen.prompts], metrics)))
    finally:
        dist.destroy_process_group()


def mean_over(rank: int, port: int, out: str) -> None:
    """Rank 1 alone logs ``reward/only_rank_1``; both write what ``mean_over_processes`` gives them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mine = {"shared": float(rank), "reward/only_rank_1": 5.0} if rank else {"shared": 0.0}
        Path(f"{out}.{rank}").write_text(repr(mean_over_processes(mine)))
    finally:
        dist.destroy_process_group()
