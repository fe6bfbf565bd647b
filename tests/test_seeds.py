"""Every sample of a run has a seed of its own: across processes, purposes (in turn, ahead, evaluation), dynamic
sampling's rounds, an episode's turns and a generation's prompts (``loop/sampler.py``, ``engines/base.py``).

vLLM seeds a request's ``j``-th sample ``seed + j``; every other part of a seed is hashed, so no two parts of the
run meet by arithmetic (a rank's seed 8 above another's met the other's next prompt, ``n`` = 8 above: 240 of 256
samples of two ranks shared a seed)."""

from itertools import product

from amir_lightning.engines.base import SEED_LIMIT, request_seed, turn_seed
from amir_lightning.loop.sampler import AHEAD, EVALUATE, TRAIN, generation_seed, round_seed


def sample_seeds(seed: int, step: int, rank: int, purpose: int, rounds: int, turns: int, prompts: int, n: int):
    """The seeds vLLM uses for every sample of one generation on one process (a server's requests)."""
    for index, turn, prompt, j in product(range(rounds), range(turns), range(prompts), range(n)):
        generation = turn_seed(round_seed(generation_seed(seed, step, rank, purpose), index), turn)
        yield request_seed(generation, prompt) + j


def test_no_two_samples_of_a_step_share_a_seed_across_ranks_purposes_rounds_turns_and_prompts():
    """2 processes x 3 purposes x 3 rounds x 2 turns x 16 prompts x 8 samples, at two steps: 4,608 samples a step,
    every seed distinct and below vLLM's limit."""
    for step in (0, 7):
        seeds = [
            s
            for rank, purpose in product((0, 1), (TRAIN, EVALUATE, AHEAD))
            for s in sample_seeds(42, step, rank, purpose, rounds=3, turns=2, prompts=16, n=8)
        ]
        assert len(seeds) == 4608 and len(set(seeds)) == len(seeds)
        assert 0 <= min(seeds) and max(seeds) < SEED_LIMIT + 8


def test_a_seed_is_a_function_of_its_place_in_the_run():
    """The same place draws the same seed (a resumed run draws what the uninterrupted one drew); a round's or a
    turn's first is the generation's own."""
    assert generation_seed(3, 5, 1, AHEAD) == generation_seed(3, 5, 1, AHEAD)
    assert round_seed(11, 0) == 11 and turn_seed(11, 0) == 11
    assert len({generation_seed(3, 5, rank, TRAIN) for rank in range(64)}) == 64
    assert len({generation_seed(seed, 0, 0, TRAIN) for seed in range(64)}) == 64
