"""Dynamic sampling against dropping alone, on a task where many groups have no reward variance.

    python benchmarks/dynamic_sampling.py --seeds 3      # configs/tiny.yaml, 30 steps per run (~30-60 s a run)
    python benchmarks/dynamic_sampling.py --arms drop dynamic_ahead

Both arms are ``amir fit --config configs/tiny.yaml`` (the tiny Qwen2 learns to copy a digit: early on most groups
score 0 everywhere, later 1 everywhere), seeded as ``benchmarks/learning.py`` seeds its runs, with held-out accuracy
before training and every 5 steps. ``drop``: ``data.rollout.drop_zero_std_groups true``, a step trains the groups
with variance its rollout had. ``dynamic``: ``data.rollout.dynamic_sampling true`` (``max_sampling_rounds`` 4),
more prompts are sampled until the step has its 16 groups with variance. ``dynamic_ahead``: the same on a
``VLLMServerEngine`` a rollout ahead (``max_staleness 1``, ``stale_logps current``): each rollout's first round is
sampled while the step before trains, its further rounds from the weights it trains. The table gives, per arm
(mean over seeds, min-max), the share of sampled groups without variance, the groups trained per step, the sampling
rounds per rollout, the held-out accuracy after 30 steps, the wall seconds of a run, and the first step and wall
second at which a seed reaches the drop arm's final mean accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from learning import ROOT, logger_args

DYNAMIC = ["--data.rollout.dynamic_sampling", "true", "--data.rollout.max_sampling_rounds", "4"]
SERVER = {"max_model_len": 64, "kv_cache_memory_bytes": 33554432, "threads": 1}
if len(os.sched_getaffinity(0)) > 1:
    SERVER["cpu_cores"] = "1"  # the server's one core, the trainer's the rest
AHEAD = ["--data.engine", json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": SERVER})]
AHEAD += ["--data.rollout.max_staleness", "1", "--data.rollout.stale_logps", "current"]
ARMS = {
    "drop": ["--data.rollout.drop_zero_std_groups", "true"],
    "dynamic": DYNAMIC,
    "dynamic_ahead": [*DYNAMIC, *AHEAD],
}
KEYS = ["val/accuracy", "rollout/zero_std_frac", "rollout/groups_kept", "rollout/sampling_rounds"]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every logged scalar of ``KEYS`` as (step, wall time, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in set(acc.Tags()["scalars"]) & set(KEYS):
            out.setdefault(tag, []).extend((e.step, e.wall_time, e.value) for e in acc.Scalars(tag))
    return out


def run(arm: str, seed: int, out: Path) -> dict:
    name = f"dynamic_sampling_{arm}_seed{seed}"
    log_dir = out / "runs" / name / "version_0"
    if not (log_dir / "cost.json").exists():  # a finished run is reused; an interrupted one starts over
        shutil.rmtree(log_dir, ignore_errors=True)
        args = [sys.executable, "-m", "amir_lightning", "fit", "--config", str(ROOT / "configs" / "tiny.yaml")]
        args += ["--seed_everything", str(seed), "--data.seed", str(seed), "--data.shuffle", "false"]
        args += ["--model.policy.init_args.seed", str(seed), *logger_args(out, name), *ARMS[arm]]
        args += ["--validate_before_fit", "true", "--trainer.check_val_every_n_epoch", "5"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = out / "runs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        with log.open("w") as sink:
            code = subprocess.run(args, env=env, cwd=out, stdout=sink, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise SystemExit(f"{name} failed (exit {code}); its output is in {log}")
        (log_dir / "cost.json").write_text(json.dumps({"start": start, "wall_s": time.time() - start}))
    cost = json.loads((log_dir / "cost.json").read_text())
    return {"scalars": scalars(log_dir), **cost}


def spread(values: list[float], digits: int = 3) -> str:
    return f"{sum(values) / len(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="drop always runs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    arms = ["drop", *(arm for arm in args.arms if arm != "drop")]  # the target is the drop arm's accuracy
    runs = {arm: [run(arm, seed, args.out.resolve()) for seed in range(args.seeds)] for arm in arms}

    def mean_of(r: dict, key: str) -> float:
        values = [v for _, _, v in r["scalars"].get(key, [])]
        return sum(values) / len(values) if values else 1.0  # no sampling_rounds logged: one round

    def final(r: dict) -> float:
        return max(r["scalars"]["val/accuracy"])[2]  # the last step's

    target = sum(final(r) for r in runs["drop"]) / len(runs["drop"])
    print(f"configs/tiny.yaml, 30 steps, {args.seeds} seeds per arm; target: the drop arm's final mean {target:.3f}")
    print("| arm | groups without variance | groups trained per step (of 16) | sampling rounds | held-out accuracy "
          "after 30 steps | wall s per run | reach target: step | reach target: wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for arm, rs in runs.items():
        reached = []
        for r in rs:
            hit = next(((s, w) for s, w, v in sorted(r["scalars"]["val/accuracy"]) if v >= target), None)
            if hit is not None:
                reached.append((hit[0], hit[1] - r["start"]))
        steps = ", ".join(str(s) for s, _ in reached) or "-"
        walls = ", ".join(f"{w:.0f}" for _, w in reached) or "-"
        print(
            f"| {arm} | {spread([mean_of(r, 'rollout/zero_std_frac') for r in rs])} | "
            f"{spread([mean_of(r, 'rollout/groups_kept') for r in rs], 1)} | "
            f"{spread([mean_of(r, 'rollout/sampling_rounds') for r in rs], 2)} | {spread([final(r) for r in rs])} | "
            f"{spread([r['wall_s'] for r in rs], 0)} | {len(reached)}/{len(rs)}: {steps} | {walls} |"
        )


if __name__ == "__main__":
    main()
