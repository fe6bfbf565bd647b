"""Reward functions with the faults users' reward code has (the run-time fault table, ``tests/test_faults.py``).

Each faulty reward scores like ``pure`` (1.0 when the completion's text is the answer, else 0.0), so a fault that
must not change training leaves the weights of a run with ``pure``.
"""

import os
import time

import torch


def pure(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def strips_eos_in_place(completions, answer, completion_ids, **kwargs):
    """The common post-processing step: drop the end-of-sequence token, on the very lists it was given."""
    for ids in completion_ids:
        if ids:
            ids.pop()
    return pure(completions, answer)


def edits_every_input(completions, answer, completion_ids, prompts, finish_reasons, **kwargs):
    for ids in completion_ids:
        ids.clear()
    scores = pure(completions, answer)
    completions.clear()
    finish_reasons[:] = ["length"] * len(finish_reasons)
    for prompt in prompts:
        if isinstance(prompt, list):
            prompt.clear()
    answer[:] = [""] * len(answer)
    return scores


def changes_directory(completions, answer, **kwargs):
    os.chdir("/")
    return pure(completions, answer)


def turns_grad_off(completions, answer, **kwargs):
    torch.set_grad_enabled(False)
    return pure(completions, answer)


def sets_float64(completions, answer, **kwargs):
    torch.set_default_dtype(torch.float64)
    return pure(completions, answer)


def takes_the_threads(completions, answer, **kwargs):
    torch.set_num_threads(2)
    return pure(completions, answer)


def parses_digits(completions, **kwargs):
    """The most obvious digit reward: int() of the completion, which raises on anything else."""
    return [float(int(c)) for c in completions]


def exits(completions, **kwargs):
    """A script's habit in a reward: exit when something looks wrong."""
    raise SystemExit(0)


def three_scores(completions, **kwargs):
    return [1.0, 0.0, 1.0]


def a_word_among_numbers(completions, **kwargs):
    return ["high"] + [0.0] * (len(completions) - 1)


def one_number(completions, **kwargs):
    return 0.5


def text(completions, **kwargs):
    return "1.0"


def a_dict(completions, **kwargs):
    return {"score": [1.0] * len(completions)}


def sleeps(completions, answer, **kwargs):
    time.sleep(float(os.environ.get("AMIR_TEST_REWARD_SLEEP", "2")))
    return pure(completions, answer)
