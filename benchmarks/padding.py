"""Padding of a training step's micro-batches: by group count, by token budget (sorted by length), and packed.

    python benchmarks/padding.py [--steps 200] [--budgets 8192 16384 32768]

Rollouts are drawn from two completion-length distributions of the qwen.yaml setting (4 groups x 8 per step,
160-token prompts): the issue's uniform 128-512 tokens, and a long tail (log-normal around 250 tokens, cut at the
1024-token limit, as reasoning models' completions are) where groups differ in length too (a per-prompt factor).
For each way of forming micro-batches the table gives the share of computed tokens that are padding and the number
of micro-batches per step, from the same ``plan_steps`` / ``build_steps`` the data module uses. Packed rows
(``model.scoring.packing``) compute no padding at all.
"""

from __future__ import annotations

import argparse
import math

import torch

from amir_lightning.engines.base import Completion
from amir_lightning.loop.batch import build_steps, plan_steps
from amir_lightning.loop.types import Group

GROUPS, GROUP_SIZE, PROMPT, LIMIT = 4, 8, 160, 1024


def draw_lengths(kind: str, gen: torch.Generator) -> list[list[int]]:
    if kind == "uniform 128-512":
        return torch.randint(128, 513, (GROUPS, GROUP_SIZE), generator=gen).tolist()
    prompt_factor = torch.randn(GROUPS, 1, generator=gen) * 0.5  # some prompts need longer answers
    logs = math.log(250) + prompt_factor + torch.randn(GROUPS, GROUP_SIZE, generator=gen) * 0.6
    return logs.exp().round().clamp(8, LIMIT).int().tolist()


def make_groups(lengths: list[list[int]]) -> list[Group]:
    zeros = torch.zeros(GROUP_SIZE)
    return [
        Group([1] * PROMPT, [Completion([2] * n, "", [0.0] * n, "stop") for n in row], zeros, zeros) for row in lengths
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[8192, 16384, 32768], help="data.rollout.micro_batch_tokens"
    )
    args = parser.parse_args()
    ways = {
        "1 group per micro-batch (qwen.yaml before)": dict(micro_batch_groups=1),
        "4 groups per micro-batch, in order": dict(micro_batch_groups=4),
    }
    for budget in args.budgets:
        ways[f"micro_batch_tokens {budget}, sorted"] = dict(micro_batch_groups=1, micro_batch_tokens=budget)
    print(f"{args.steps} steps of {GROUPS} groups x {GROUP_SIZE}, {PROMPT}-token prompts")
    print("| completions | micro-batches formed by | padding share | micro-batches per step | largest, tokens |")
    print("|---|---|---|---|---|")
    for kind in ("uniform 128-512", "long tail (log-normal, <= 1024)"):
        gen = torch.Generator().manual_seed(0)
        rollouts = [make_groups(draw_lengths(kind, gen)) for _ in range(args.steps)]
        for name, way in ways.items():
            real = padded = batches = largest = 0
            for groups in rollouts:
                (step,) = build_steps(plan_steps(groups, 1, **way), pad_id=0)
                for batch in step.micro_batches:
                    real += int(batch.attention_mask.sum())
                    padded += batch.attention_mask.numel()
                    largest = max(largest, batch.attention_mask.numel())
                batches += len(step.micro_batches)
            share = 1 - real / padded
            print(f"| {kind} | {name} | {share:.1%} | {batches / args.steps:.2f} | {largest} |")
        print(f"| {kind} | packed rows (model.scoring.packing) | 0.0% | - | - |")


if __name__ == "__main__":
    main()
