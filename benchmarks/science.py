"""Does the pair term do what the paper says, where it says it matters? Many seeds, paired by seed, with intervals.

    python benchmarks/science.py length --seeds 20                       # every aggregation, GRPO vs AMIR-GRPO
    python benchmarks/science.py length --seeds 20 --aggregations grpo --fixed-lambda 0.5 2 8 --jobs 2

``length``: ``configs/length_bias.yaml``, a tiny Qwen2 where every completion over 4 tokens is wrong (a controlled
length bias, docs/science.md). Arms: GRPO (``GRPOLoss``), AMIR-GRPO with the config's adaptive lambda, and
AMIR-GRPO with lambda fixed at each ``--fixed-lambda``; each under every ``--aggregations``. A seed sets the model's
initialisation, the prompts and the sampling, so the arms of one seed share their first rollout: differences are
taken by seed (paired).

Per run, the final value of a metric is its mean over the last 5 optimisation steps (``@run``: over all
steps). The tables give, per arm, the mean over seeds with a bootstrap 95 % interval, and against GRPO of the same
aggregation the paired difference (mean, bootstrap 95 % interval), its effect size ``d_z`` (mean difference / its
standard deviation) and the smallest difference the seeds could detect (two-sided 5 %, power 80 %:
``2.80 sd / sqrt(n)``). Plots of every seed's curves go to ``--img``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml
from learning import scalars

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"length": ROOT / "configs" / "length_bias.yaml"}
#: Metric, its label, and whether larger is better (for the reader; the tables give signed differences).
METRICS = {
    "rollout/accuracy": "training accuracy",
    "length/long_incorrect_frac": "long wrong completions (share)",
    "length/long_incorrect_frac@run": "long wrong completions (share), mean over the whole run",
    "length/gap": "length gap, wrong - correct (tokens)",
    "amir/pair_margin": "pair margin (mean log-prob, chosen - rejected)",
    "length/mean": "completion length (tokens)",
}
PLOTTED = ["rollout/accuracy", "length/long_incorrect_frac", "amir/pair_margin", "length/gap"]
FINAL_STEPS = 5
RESAMPLES = 10_000


def arm_loss(arm: str, aggregation: str, config: Path) -> dict:
    """``model.loss`` of an arm: ``GRPO``, ``AMIR-GRPO`` (the config's adaptive lambda) or ``AMIR-GRPO lambda=x``.

    The arms keep the config's KL weight ``beta``; the pair term's settings are the config's.
    """
    given = dict(yaml.safe_load(config.read_text())["model"]["loss"]["init_args"])
    beta = given.get("beta", 0.0)
    if arm == "GRPO":
        return {
            "class_path": "amir_lightning.objectives.GRPOLoss",
            "init_args": {"aggregation": aggregation, "beta": beta},
        }
    init = dict(given, aggregation=aggregation)
    if "=" in arm:
        init.update(lambda_=float(arm.split("=", 1)[1]), lambda_schedule="fixed")
    return {"class_path": "amir_lightning.objectives.AmirGRPOLoss", "init_args": init}


def run_name(task: str, arm: str, aggregation: str, seed: int) -> str:
    return f"{task}_{aggregation}_{arm.replace(' ', '_').replace('=', '')}_seed{seed}"


def run(task: str, arm: str, aggregation: str, seed: int, out: Path) -> dict[str, list[tuple[int, float]]]:
    """One ``amir fit`` (reused when it finished before); its TensorBoard scalars."""
    name = run_name(task, arm, aggregation, seed)
    log_dir = out / "runs" / name / "version_0"
    if not (log_dir / "cost.json").exists():
        shutil.rmtree(log_dir, ignore_errors=True)
        args = [sys.executable, "-m", "amir_lightning", "fit", "--config", str(CONFIGS[task])]
        args += ["--seed_everything", str(seed), "--data.seed", str(seed), "--model.policy.init_args.seed", str(seed)]
        args += ["--model.loss", json.dumps(arm_loss(arm, aggregation, CONFIGS[task]))]
        args += ["--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name]
        args += ["--trainer.logger.init_args.version", "0", "--trainer.check_val_every_n_epoch", "1000"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = out / "runs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with log.open("w") as sink:
            status = subprocess.run(args, env=env, cwd=out, stdout=sink, stderr=subprocess.STDOUT).returncode
        if status != 0:
            raise SystemExit(f"{name} failed (exit {status}); its output is in {log}")
        (log_dir / "cost.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))
    return scalars(log_dir)


def final(result: dict[str, list[tuple[int, float]]], key: str) -> float:
    """The mean of the last ``FINAL_STEPS`` values of ``key``; of all its values for ``<key>@run``."""
    name, _, scope = key.partition("@")
    values = [v for _, v in sorted(result.get(name, []))]
    values = values if scope == "run" else values[-FINAL_STEPS:]
    return float(np.mean(values)) if values else float("nan")


def bootstrap(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95 % percentile interval of the mean."""
    if len(values) < 2:
        return float("nan"), float("nan")
    means = values[rng.integers(0, len(values), (RESAMPLES, len(values)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired(diff: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """Mean paired difference, its bootstrap interval, d_z and the smallest detectable difference."""
    low, high = bootstrap(diff, rng)
    sd = float(diff.std(ddof=1)) if len(diff) > 1 else float("nan")
    return {
        "mean": float(diff.mean()),
        "low": low,
        "high": high,
        "d_z": float(diff.mean() / sd) if sd > 0 else float("nan"),
        "detectable": 2.80 * sd / np.sqrt(len(diff)),
    }


def summarise(finals: dict, arms: list[str], aggregations: list[str], seeds: int) -> dict:
    rng = np.random.default_rng(0)
    table = {}
    for aggregation in aggregations:
        for arm in arms:
            for key in METRICS:
                values = np.array([finals[aggregation][arm][s].get(key, np.nan) for s in range(seeds)])
                base = np.array([finals[aggregation]["GRPO"][s].get(key, np.nan) for s in range(seeds)])
                ok = ~np.isnan(values)
                entry = {"mean": float(values[ok].mean()) if ok.any() else float("nan"), "n": int(ok.sum())}
                entry["low"], entry["high"] = bootstrap(values[ok], rng)
                both = ok & ~np.isnan(base)
                if arm != "GRPO" and both.sum() > 1:
                    entry["vs_grpo"] = paired(values[both] - base[both], rng)
                table[f"{aggregation}|{arm}|{key}"] = entry
    return table


def print_tables(table: dict, arms: list[str], aggregations: list[str], seeds: int, lam: dict) -> None:
    for key, label in METRICS.items():
        scope = "mean over all steps" if key.endswith("@run") else f"final: mean of the last {FINAL_STEPS} steps"
        print(f"\n{label} (`{key}`), {scope}, {seeds} seeds")
        print("| aggregation | arm | mean [95 % CI] | vs GRPO, paired [95 % CI] | d_z | detectable |")
        print("|---|---|---|---|---|---|")
        for aggregation in aggregations:
            for arm in arms:
                e = table.get(f"{aggregation}|{arm}|{key}")
                if e is None or e["n"] == 0:
                    continue
                row = f"| {aggregation} | {arm} | {e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}] |"
                v = e.get("vs_grpo")
                if v:
                    interval = f"[{v['low']:+.3f}, {v['high']:+.3f}]"
                    row += f" {v['mean']:+.3f} {interval} | {v['d_z']:+.2f} | {v['detectable']:.3f} |"
                else:
                    row += " - | - | - |"
                print(row)
    print("\npair push-down per token / GRPO's (`length/pair_to_pg`, mean over the run) and lambda (`amir/lambda`)")
    print("| aggregation | arm | pair_to_pg | lambda |")
    print("|---|---|---|---|")
    for (aggregation, arm), (ratio, weight) in lam.items():
        print(f"| {aggregation} | {arm} | {ratio:.3f} | {weight:.4f} |")


def plot(curves: dict, aggregations: list[str], arms: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(aggregations), len(PLOTTED), figsize=(4.2 * len(PLOTTED), 3.2 * len(aggregations)))
    axes = np.atleast_2d(axes)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, aggregation in enumerate(aggregations):
        for col, key in enumerate(PLOTTED):
            ax = axes[row, col]
            for i, arm in enumerate(arms):
                runs = [dict(r.get(key, [])) for r in curves[aggregation][arm]]
                steps = sorted(set.intersection(*(set(r) for r in runs))) if runs and all(runs) else []
                if not steps:
                    continue
                values = np.array([[r[t] for t in steps] for r in runs])
                for seed_values in values:
                    ax.plot(steps, seed_values, color=colours[i % len(colours)], alpha=0.12, linewidth=0.7)
                ax.plot(steps, values.mean(0), color=colours[i % len(colours)], label=arm, linewidth=2)
            ax.set_title(f"{aggregation}: {key}", fontsize=9)
            ax.set_xlabel("optimisation step")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(CONFIGS))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--aggregations", nargs="+", default=["grpo", "dapo", "dr_grpo"])
    parser.add_argument("--fixed-lambda", type=float, nargs="*", default=[], help="AMIR-GRPO arms at fixed lambda")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/science"))
    parser.add_argument("--img", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    arms = ["GRPO", "AMIR-GRPO", *(f"AMIR-GRPO lambda={lam:g}" for lam in args.fixed_lambda)]
    jobs = [(arm, agg, seed) for agg in args.aggregations for arm in arms for seed in range(args.seeds)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run(args.task, *job, args.out.resolve()), jobs))
    curves: dict = {agg: {arm: [] for arm in arms} for agg in args.aggregations}
    for (arm, agg, _), result in zip(jobs, results):
        curves[agg][arm].append(result)
    finals = {
        agg: {arm: [{k: final(r, k) for k in METRICS} for r in curves[agg][arm]] for arm in arms}
        for agg in args.aggregations
    }
    lam = {}
    for agg in args.aggregations:
        for arm in arms[1:]:
            ratio = np.nanmean(
                [np.mean([v for _, v in r.get("length/pair_to_pg", [(0, np.nan)])]) for r in curves[agg][arm]]
            )
            weight = np.nanmean(
                [np.mean([v for _, v in r.get("amir/lambda", [(0, np.nan)])]) for r in curves[agg][arm]]
            )
            lam[(agg, arm)] = (float(ratio), float(weight))
    table = summarise(finals, arms, args.aggregations, args.seeds)
    took = time.perf_counter() - start
    print(f"task {args.task} ({CONFIGS[args.task].relative_to(ROOT)}), {len(jobs)} runs, {took:.0f} s")
    print_tables(table, arms, args.aggregations, args.seeds, lam)
    (args.out / f"{args.task}_summary.json").write_text(json.dumps({"table": table, "finals": finals}, indent=1))
    args.img.mkdir(parents=True, exist_ok=True)
    png = args.img / f"science_{args.task}.png"
    plot(curves, args.aggregations, arms, png, f"{args.task}: every seed (thin) and the mean (thick)")
    print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
