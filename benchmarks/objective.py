"""Time the GRPO and AMIR-GRPO objectives from token log-probs to the backward into the log-probs.

    python benchmarks/objective.py [--groups 64] [--group-size 8] [--tokens 512] [--repeats 41]

Every objective sees the same step (N = groups x group_size completions of up to T tokens, ragged lengths, a
k3 KL to a reference with beta 0.001 as in the official runs), on-policy (old = None: the official setting) and
off-policy (old log-probs given, ratios and clipping active). Timings interleave the objectives in one process
(A B B A ...) and report medians, so machine noise hits all alike; the ratio AMIR / GRPO is the figure of merit
(target <= 1.03). For context, ``autograd GRPO`` is the same GRPO loss written the shortest way (TRL's formula,
no step context, no statistics), also differentiated by autograd.

glibc returns freed multi-megabyte blocks to the OS and faults them back in on the next allocation, which made
these timings swing by 2x between runs; the script raises its mmap and trim thresholds (mallopt) first.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import time

import torch

from amir_lightning.objectives import AmirGRPOLoss, GRPOLoss, group_advantages


def _steady_malloc() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


class AutogradGRPO(torch.nn.Module):
    """GRPO as TRL writes it (token ratios, clip, k3 KL, aggregation), differentiated by autograd."""

    def __init__(self, aggregation: str, beta: float, epsilon: float = 0.2) -> None:
        super().__init__()
        self.aggregation, self.beta, self.epsilon = aggregation, beta, epsilon

    def forward(self, logps, mask, advantages, rewards, group_size, old_logps=None, ref_logps=None):
        old = logps.detach() if old_logps is None else old_logps
        ratio = torch.exp(logps - old)
        adv = advantages.unsqueeze(1)
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.epsilon, 1 + self.epsilon) * adv)
        delta = ref_logps - logps
        per_token = per_token + self.beta * (torch.exp(delta) - delta - 1)
        if self.aggregation == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        else:
            loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        return type("Out", (), {"loss": loss})


def make_step(groups: int, group_size: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    lengths = torch.randint(tokens // 4, tokens + 1, (n,), generator=gen)
    mask = (torch.arange(tokens) < lengths.unsqueeze(1)).float()
    rewards = torch.randint(0, 4, (n,), generator=gen).float() * 0.7
    logps = -torch.rand(n, tokens, generator=gen) * 2
    return {
        "logps": logps,
        "mask": mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_size),
        "old": logps + 0.05 * torch.randn(n, tokens, generator=gen),
        "ref": logps + 0.05 * torch.randn(n, tokens, generator=gen),
    }


def time_once(loss: torch.nn.Module, step: dict[str, torch.Tensor], group_size: int, on_policy: bool) -> float:
    logps = step["logps"].clone().requires_grad_(True)
    start = time.perf_counter()
    out = loss(
        logps,
        step["mask"],
        step["advantages"],
        step["rewards"],
        group_size,
        old_logps=None if on_policy else step["old"],
        ref_logps=step["ref"],
    )
    out.loss.backward()
    return time.perf_counter() - start


def measure(losses: dict[str, torch.nn.Module], step, group_size: int, on_policy: bool, repeats: int):
    times = {name: [] for name in losses}
    names = list(losses)
    for _ in range(3):
        for name in names:
            time_once(losses[name], step, group_size, on_policy)
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(time_once(losses[name], step, group_size, on_policy))
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    _steady_malloc()
    torch.set_num_threads(args.threads)
    step = make_step(args.groups, args.group_size, args.tokens)
    n = args.groups * args.group_size
    pairs = int(AmirGRPOLoss().pairs(step["rewards"], args.group_size).shape[0])
    print(
        f"objective forward+backward, N = {args.groups} x {args.group_size} = {n} completions, T = {args.tokens}, "
        f"{pairs} pairs, {args.threads} thread(s), torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, median of {args.repeats}"
    )
    print("| aggregation | policy | GRPO ms | AMIR ms | AMIR / GRPO | autograd GRPO ms | autograd / AMIR |")
    print("|---|---|---|---|---|---|---|")
    for aggregation in ("grpo", "dapo"):
        for on_policy in (True, False):
            losses = {
                "grpo": GRPOLoss(aggregation=aggregation, kl_coef=0.001),
                "amir": AmirGRPOLoss(aggregation=aggregation, kl_coef=0.001),
                "autograd": AutogradGRPO(aggregation, beta=0.001),
            }
            t = measure(losses, step, args.group_size, on_policy, args.repeats)
            print(
                f"| {aggregation} | {'on' if on_policy else 'off'} | {t['grpo']:.2f} | {t['amir']:.2f} | "
                f"{t['amir'] / t['grpo']:.3f} | {t['autograd']:.2f} | {t['autograd'] / t['amir']:.2f} |"
            )


if __name__ == "__main__":
    main()
