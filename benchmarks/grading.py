"""Throughput and worst-case latency of the sandboxed grader on adversarial completions.

    python benchmarks/grading.py [--count 10000] [--workers 2] [--timeout 2.0]

Every completion is graded by math-verify in a worker process with a hard wall-clock limit and a memory cap;
the table shows answers per second, latency percentiles (hand-over to answer), timeouts and the score range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from amir_lightning.rewards.fuzz import adversarial_completions
from amir_lightning.rewards.grading import grade_answer
from amir_lightning.rewards.sandbox import SandboxedGrader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = adversarial_completions(args.count, args.seed)
    grader = SandboxedGrader(timeout_s=args.timeout, num_workers=args.workers)
    grader.map(grade_answer, [("\\boxed{1}", "1")])  # workers up before the clock starts
    start = time.perf_counter()
    scores = grader.map(grade_answer, cases)
    elapsed = time.perf_counter() - start
    lat = sorted(grader.latencies)
    grader.close()
    ok = all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in scores)
    print(
        f"sandboxed grading of {len(cases)} adversarial completions, {args.workers} workers, "
        f"timeout {args.timeout} s, {os.cpu_count()} cores"
    )
    print("| answers | seconds | answers/s | median ms | p99 ms | worst ms | timeouts | scores in [0, 1] |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {len(cases)} | {elapsed:.1f} | {len(cases) / elapsed:.0f} | {1e3 * statistics.median(lat):.2f} | "
        f"{1e3 * lat[int(0.99 * (len(lat) - 1))]:.1f} | {1e3 * lat[-1]:.0f} | {grader.timeouts} | {ok} |"
    )


if __name__ == "__main__":
    main()
