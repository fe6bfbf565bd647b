"""Does the pair term do what the paper says, where it says it matters? Many seeds, paired by seed, with intervals.

    python benchmarks/science.py length --seeds 20                       # every aggregation, GRPO vs AMIR-GRPO
    python benchmarks/science.py length --seeds 20 --aggregations grpo --fixed-lambda 0.5 2 8 --jobs 2
    python benchmarks/science.py length --seeds 20 --no-adaptive --sum-lambda 0.2     # the pair term on sums
    python benchmarks/science.py smol --seeds 5 --aggregations grpo      # SmolLM2, then amir test on held-out sums
    python benchmarks/science.py smol3 --seeds 5 --aggregations grpo --fixed-lambda 0.5 --prompt-seeds --tag _ps

``length``: ``configs/length_bias.yaml``, a tiny Qwen2 where every completion over 4 tokens is wrong (a controlled
length bias, docs/science.md); ``length_long`` reverses it (every completion of at most 4 tokens is wrong).
``smol``: ``configs/science_smol.yaml``, the bundled SmolLM2 on sums "step by step"
(about 90 tokens a completion); after each run ``amir test`` samples 8 completions of 48 held-out problems, and the
script adds held-out pass@k, coverage by seed (the paper's Table 2), pooled margin violins (its Figure 4) and the
``amir compare`` report of each seed. ``smol3``: ``configs/science_smol3.yaml``, the same on three-term sums of 0-9
"step by step" (about 115 tokens a completion).

Arms: GRPO (``GRPOLoss``), AMIR-GRPO with the config's adaptive lambda (``--no-adaptive`` leaves it out),
AMIR-GRPO with lambda fixed at each ``--fixed-lambda``, and with lambda fixed at each ``--sum-lambda`` and the pair
term on summed sequence log-probs (``reduction: sum``); each under every ``--aggregations``. A seed sets the
model's initialisation (tiny model) and the sampling, so the arms of one seed share their first rollout:
differences are taken by seed (paired). The prompt sequence is the same for every seed (the runs pass
``--data.shuffle false``, and ``ArithmeticPrompts`` draws from its own ``seed``) unless ``--prompt-seeds`` sets
that seed too.

Per run, the final value of a metric is its mean over the last 5 optimisation steps (``@run``: over all
steps). The tables give, per arm, the mean over seeds with a bootstrap 95 % interval, and against GRPO of the same
aggregation the paired difference (mean, bootstrap 95 % interval), the two-sided p of the sign-flip permutation
test (exact up to 16 seeds; never below 2 / 2^n), its effect size ``d_z`` (mean difference / its
standard deviation) and the smallest difference the seeds could detect (two-sided 5 %, power 80 %:
``(t_.975 + t_.80) sd / sqrt(n)`` with n - 1 degrees of freedom; 2.95 at 20 seeds, 3.72 at 5). Plots of every
seed's curves go to ``--img``.
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
from learning import logger_args, scalars

from amir_lightning.evaluation.compare import compare, problem_margins, violin_plot

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "length": ROOT / "configs" / "length_bias.yaml",
    "length_long": ROOT / "configs" / "length_bias.yaml",
    "smol": ROOT / "configs" / "science_smol.yaml",
    "smol3": ROOT / "configs" / "science_smol3.yaml",
}
#: Arguments a task adds to its config's: ``length_long`` is the reverse setting, a right answer counts only in a
#: completion over 4 tokens.
REVERSED = {"class_path": "amir_lightning.rewards.LengthControlledAnswerReward"}
REVERSED["init_args"] = {"threshold_tokens": 4, "correct_when": "long"}
TASK_ARGS = {"length_long": ["--data.rewards", json.dumps([REVERSED])]}
#: Tasks whose model is built from a seed (the tiny model); the bundled SmolLM2 starts from its trained weights.
SEEDED_INIT = {"length", "length_long"}
#: Metric and its label (the tables give signed differences: read the label for which way is better).
METRICS = {
    "rollout/accuracy": "training accuracy",
    "rollout/accuracy@run": "training accuracy, mean over the whole run",
    "length/long_incorrect_frac": "long wrong completions (share)",
    "length/long_incorrect_frac@run": "long wrong completions (share), mean over the whole run",
    "length/gap": "length gap, wrong - correct (tokens)",
    "amir/pair_margin": "pair margin (mean log-prob, chosen - rejected)",
    "length/mean": "completion length (tokens)",
}
#: Held-out metrics of ``amir test`` (tasks in ``HELD_OUT``), from its per-problem report.
HELD_OUT_METRICS = {
    "heldout/pass@1": "held-out pass@1",
    "heldout/pass@2": "held-out pass@2",
    "heldout/pass@4": "held-out pass@4",
    "heldout/solved": "held-out problems solved by at least one of 8 samples (share)",
    "heldout/margin": "held-out margin, correct - incorrect mean log-prob (problems with both)",
    "heldout/length_gap": "held-out length gap, incorrect - correct (tokens)",
}
METRICS.update(HELD_OUT_METRICS)
#: Tasks evaluated on held-out problems with ``amir test`` after training.
HELD_OUT = {"smol", "smol3"}
PLOTTED = ["rollout/accuracy", "length/long_incorrect_frac", "amir/pair_margin", "length/gap"]
FINAL_STEPS = 5
RESAMPLES = 10_000


def arm_loss(arm: str, aggregation: str, config: Path) -> dict:
    """``model.loss`` of an arm: ``GRPO``, ``AMIR-GRPO`` (the config's adaptive lambda), ``AMIR-GRPO lambda=x``
    or ``AMIR-GRPO sum lambda=x`` (summed, not length-normalised, sequence log-probs in the pair term).

    The arms keep the config's KL weight ``kl_coef``; the pair term's settings are the config's.
    """
    given = dict(yaml.safe_load(config.read_text())["model"]["loss"]["init_args"])
    kl_coef = given.get("kl_coef", 0.0)
    if arm == "GRPO":
        return {
            "class_path": "amir_lightning.objectives.GRPOLoss",
            "init_args": {"aggregation": aggregation, "kl_coef": kl_coef},
        }
    init = dict(given, aggregation=aggregation)
    if "=" in arm:
        init["pair_weight"] = {"value": float(arm.split("=", 1)[1]), "schedule": "fixed"}
    if " sum " in arm:  # the pair term on summed sequence log-probs (the first official commit's form)
        init["pair_term"] = dict(init.get("pair_term") or {}, reduction="sum")
    return {"class_path": "amir_lightning.objectives.AmirGRPOLoss", "init_args": init}


#: ``--prompt-seeds``: the seed also sets the prompts' draw (``data.prompts.init_args.seed``); such runs end in _ps.
PROMPT_SEEDS = {"on": False}


def run_name(task: str, arm: str, aggregation: str, seed: int) -> str:
    suffix = "_ps" if PROMPT_SEEDS["on"] else ""
    return f"{task}_{aggregation}_{arm.replace(' ', '_').replace('=', '')}_seed{seed}{suffix}"


def command(args: list[str], log: Path, what: str) -> float:
    """Run ``amir`` with ``args`` offline on one thread, its output in ``log``; the seconds it took."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as sink:
        cmd = [sys.executable, "-m", "amir_lightning", *args]
        status = subprocess.run(cmd, env=env, cwd=log.parent, stdout=sink, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise SystemExit(f"{what} failed (exit {status}); its output is in {log}")
    return time.perf_counter() - start


def run(task: str, arm: str, aggregation: str, seed: int, out: Path) -> dict[str, list[tuple[int, float]]]:
    """One ``amir fit`` (reused when it finished before); its TensorBoard scalars."""
    name = run_name(task, arm, aggregation, seed)
    log_dir = out / "runs" / name / "version_0"
    if not (log_dir / "cost.json").exists():
        shutil.rmtree(log_dir, ignore_errors=True)
        args = ["fit", "--config", str(CONFIGS[task]), "--seed_everything", str(seed), "--data.seed", str(seed)]
        args += ["--model.policy.init_args.seed", str(seed)] if task in SEEDED_INIT else []
        args += TASK_ARGS.get(task, [])
        # one prompt sequence for every seed, or (--prompt-seeds) one drawn by the source's own seed
        args += ["--data.shuffle", "false"]
        args += ["--data.prompts.init_args.seed", str(seed)] if PROMPT_SEEDS["on"] else []
        args += ["--model.loss", json.dumps(arm_loss(arm, aggregation, CONFIGS[task]))]
        args += [*logger_args(out, name), "--trainer.check_val_every_n_epoch", "1000"]
        took = command(args, out / "runs" / f"{name}.log", name)
        (log_dir / "cost.json").write_text(json.dumps({"wall_s": took}))
    return scalars(log_dir)


def held_out(task: str, arm: str, aggregation: str, seed: int, out: Path) -> dict:
    """``amir test`` of a run's last checkpoint (``arm`` ``base``: the untrained model); its held-out report.

    Every test samples with seed 0, so runs differ only in their weights.
    """
    trained = arm != "base"
    name = (run_name(task, arm, aggregation, seed) if trained else f"{task}_base") + "_test"
    report = out / "runs" / name / "version_0" / "eval" / "heldout.json"
    if not report.exists():
        args = ["test", "--config", str(CONFIGS[task]), "--seed_everything", "0", "--data.seed", "0"]
        if trained:
            checkpoint = out / "runs" / run_name(task, arm, aggregation, seed) / "version_0" / "checkpoints"
            args += ["--model.loss", json.dumps(arm_loss(arm, aggregation, CONFIGS[task]))]
            args += ["--ckpt_path", str(checkpoint / "last.ckpt")]
        command([*args, *logger_args(out, name)], out / "runs" / f"{name}.log", name)
    return json.loads(report.read_text())


def final(result: dict[str, list[tuple[int, float]]], key: str) -> float:
    """The mean of the last ``FINAL_STEPS`` values of ``key``; of all its values for ``<key>@run``."""
    name, _, scope = key.partition("@")
    values = [v for _, v in sorted(result.get(name, []))]
    values = values if scope == "run" else values[-FINAL_STEPS:]
    return float(np.mean(values)) if values else float("nan")


def held_out_metrics(report: dict) -> dict[str, float]:
    """pass@k, the solved share, the mean margin and the length gap of one held-out report."""
    problems = report["problems"]
    margins = problem_margins(report)
    lengths = {c: [n for p in problems for n, ok in zip(p["lengths"], p["correct"]) if ok == c] for c in (0, 1)}
    gap = np.mean(lengths[0]) - np.mean(lengths[1]) if lengths[0] and lengths[1] else float("nan")
    out = {f"heldout/pass@{k}": v for k, v in report["pass@k"].items()}
    out["heldout/solved"] = float(np.mean([any(p["correct"]) for p in problems]))
    out["heldout/margin"] = float(np.mean(margins)) if margins else float("nan")
    out["heldout/length_gap"] = float(gap)
    return out


def coverage_table(reports: dict, arms: list[str], aggregation: str, seeds: int) -> None:
    """Table 2 by seed: held-out problems solved by GRPO only, the AMIR arm only, both; the paired difference."""
    rng = np.random.default_rng(1)
    print(f"\ncoverage of held-out problems ({aggregation}; solved = one of 8 samples correct), {seeds} seeds\n")
    print("| arm | solved by both | GRPO only | arm only | neither | arm only - GRPO only, per seed [95 % CI] |")
    print("|---|---|---|---|---|---|")
    for arm in arms[1:]:
        counts, diffs = np.zeros(4, int), []
        for seed in range(seeds):
            grpo = [any(p["correct"]) for p in reports[aggregation]["GRPO"][seed]["problems"]]
            other = [any(p["correct"]) for p in reports[aggregation][arm][seed]["problems"]]
            pairs = list(zip(grpo, other))
            seed_counts = [sum(g and o for g, o in pairs), sum(g and not o for g, o in pairs)]
            seed_counts += [sum(o and not g for g, o in pairs), sum(not (g or o) for g, o in pairs)]
            counts += seed_counts
            diffs.append(seed_counts[2] - seed_counts[1])
        low, high = bootstrap(np.array(diffs, float), rng)
        cells = " | ".join(str(c) for c in counts)
        print(f"| {arm} | {cells} | {np.mean(diffs):+.1f} [{low:+.1f}, {high:+.1f}] |")


def bootstrap(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95 % percentile interval of the mean."""
    if len(values) < 2:
        return float("nan"), float("nan")
    means = values[rng.integers(0, len(values), (RESAMPLES, len(values)))].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


#: Student t quantiles 0.975 and 0.80 by degrees of freedom (1-19); beyond, the normal's 1.960 and 0.842.
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T_975 += [2.120, 2.110, 2.101, 2.093]
T_80 = [1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866]
T_80 += [0.865, 0.863, 0.862, 0.861]


def detectable(sd: float, n: int) -> float:
    """Smallest mean paired difference ``n`` seeds detect (two-sided 5 %, power 80 %): ``(t_.975 + t_.80) sd/sqrt(n)``.

    The t quantiles (n - 1 degrees of freedom) make it 33 % larger at 5 seeds than the normal approximation 2.80.
    """
    factor = T_975[n - 2] + T_80[n - 2] if 2 <= n <= len(T_975) + 1 else 1.960 + 0.842
    return factor * sd / np.sqrt(n)


def sign_flip_p(diff: np.ndarray, rng: np.random.Generator) -> float:
    """Two-sided p of the paired sign-flip (permutation) test of mean difference 0.

    Under the null each seed's difference is as likely negative as positive; the p is the share of sign patterns
    whose |mean| reaches the observed one. Exact for up to 16 seeds, else 200,000 random patterns. With n seeds it
    cannot go below 2 / 2^n (0.0625 for 5 seeds): bootstrap percentile intervals are too narrow at such n.
    """
    n = len(diff)
    if n <= 16:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2 - 1
    else:
        signs = rng.choice(np.array([-1, 1]), size=(200_000, n))
    means = np.abs((signs * diff).mean(1))
    return float(np.mean(means >= abs(diff.mean()) * (1 - 1e-9)))


def paired(diff: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """Mean paired difference, its bootstrap interval, sign-flip p, d_z and the smallest detectable difference."""
    low, high = bootstrap(diff, rng)
    sd = float(diff.std(ddof=1)) if len(diff) > 1 else float("nan")
    return {
        "mean": float(diff.mean()),
        "low": low,
        "high": high,
        "p": sign_flip_p(diff, rng),
        "d_z": float(diff.mean() / sd) if sd > 0 else float("nan"),
        "detectable": detectable(sd, len(diff)),
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
        if not any(table.get(f"{agg}|{arm}|{key}", {}).get("n") for agg in aggregations for arm in arms):
            continue
        scope = "mean over all steps" if key.endswith("@run") else f"final: mean of the last {FINAL_STEPS} steps"
        scope = "after training" if key in HELD_OUT_METRICS else scope
        print(f"\n{label} (`{key}`), {scope}, {seeds} seeds\n")
        print("| aggregation | arm | mean [95 % CI] | vs GRPO, paired [95 % CI] | p (sign-flip) | d_z | detectable |")
        print("|---|---|---|---|---|---|---|")
        for aggregation in aggregations:
            for arm in arms:
                e = table.get(f"{aggregation}|{arm}|{key}")
                if e is None or e["n"] == 0:
                    continue
                row = f"| {aggregation} | {arm} | {e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}] |"
                v = e.get("vs_grpo")
                if v:
                    interval = f"[{v['low']:+.3f}, {v['high']:+.3f}]"
                    row += f" {v['mean']:+.3f} {interval} | {v['p']:.3f} | {v['d_z']:+.2f} | {v['detectable']:.3f} |"
                else:
                    row += " - | - | - | - |"
                print(row)
    print("\npair push-down per token / GRPO's (`length/pair_to_pg`, mean over the run) and lambda (`amir/lambda`)\n")
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


def seed_range(args: argparse.Namespace) -> range:
    """The seeds of a call: ``--first-seed`` and the ``--seeds`` after it."""
    return range(args.first_seed, args.first_seed + args.seeds)


def print_held_out(base: dict, reports: dict, arms: list[str], args: argparse.Namespace, out: Path) -> None:
    """The untrained model's held-out figures, coverage, the pooled margin violins and ``amir compare`` per seed."""
    print("\nuntrained model, held out: " + ", ".join(f"{k} {v:.3f}" for k, v in held_out_metrics(base).items()))
    for agg in args.aggregations:
        coverage_table(reports, arms, agg, args.seeds)
        margins = [problem_margins(base)] + [[m for r in reports[agg][arm] for m in problem_margins(r)] for arm in arms]
        png = args.img / f"science_{args.task}{args.tag}_margins_{agg}.png"
        title = f"held-out margins, {args.seeds} seeds pooled ({agg})"
        violin_plot(png, ["untrained", *arms], margins, title)
        print(f"margin violins: {png}")
        # what `amir compare base GRPO AMIR-GRPO ...` writes, one seed at a time
        for seed in seed_range(args):
            names = [run_name(args.task, arm, agg, seed) + "_test" for arm in arms]
            runs = [out / "runs" / f"{args.task}_base_test" / "version_0"]
            runs += [out / "runs" / name / "version_0" for name in names]
            compare(runs, ["untrained", *arms], out / f"compare_{args.task}_{agg}_seed{seed}")
        print(f"amir compare, per seed: {out}/compare_{args.task}_{agg}_seed<seed>/compare.md")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=sorted(CONFIGS))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--aggregations", nargs="+", default=["grpo", "dapo", "dr_grpo"])
    parser.add_argument("--fixed-lambda", type=float, nargs="*", default=[], help="AMIR-GRPO arms at fixed lambda")
    parser.add_argument(
        "--sum-lambda", type=float, nargs="*", default=[], help="AMIR-GRPO arms at fixed lambda, pair term on sums"
    )
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True, help="the adaptive arm")
    parser.add_argument(
        "--prompt-seeds", action="store_true", help="the seed also sets the prompt draw (default: one draw for all)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/science"))
    parser.add_argument("--img", type=Path, default=Path("docs/img"))
    parser.add_argument("--tag", default="", help="suffix of the summary and plot names (science_<task><tag>.png)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    PROMPT_SEEDS["on"] = args.prompt_seeds
    arms = [
        "GRPO",
        *(["AMIR-GRPO"] if args.adaptive else []),
        *(f"AMIR-GRPO lambda={lam:g}" for lam in args.fixed_lambda),
    ]
    arms += [f"AMIR-GRPO sum lambda={lam:g}" for lam in args.sum_lambda]
    jobs = [(arm, agg, seed) for agg in args.aggregations for arm in arms for seed in seed_range(args)]
    start = time.perf_counter()
    out, tested = args.out.resolve(), args.task in HELD_OUT

    def fit_and_test(job: tuple[str, str, int]) -> tuple[dict, dict | None]:
        result = run(args.task, *job, out)
        return result, held_out(args.task, *job, out) if tested else None

    with ThreadPoolExecutor(args.jobs) as pool:
        base = pool.submit(held_out, args.task, "base", "", 0, out) if tested else None
        results = list(pool.map(fit_and_test, jobs))
    curves: dict = {agg: {arm: [] for arm in arms} for agg in args.aggregations}
    reports: dict = {agg: {arm: [] for arm in arms} for agg in args.aggregations}
    for (arm, agg, _), (result, report) in zip(jobs, results):
        curves[agg][arm].append(result)
        reports[agg][arm].append(report)
    finals = {
        agg: {
            arm: [
                {**{k: final(r, k) for k in METRICS}, **(held_out_metrics(rep) if rep else {})}
                for r, rep in zip(curves[agg][arm], reports[agg][arm])
            ]
            for arm in arms
        }
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
    summary = args.out / f"{args.task}{args.tag}_summary.json"
    summary.write_text(json.dumps({"table": table, "finals": finals}, indent=1))
    args.img.mkdir(parents=True, exist_ok=True)
    if tested:
        print_held_out(base.result(), reports, arms, args, out)
    png = args.img / f"science_{args.task}{args.tag}.png"
    plot(curves, args.aggregations, arms, png, f"{args.task}: every seed (thin) and the mean (thick)")
    print(f"\nplot: {png}")


if __name__ == "__main__":
    main()
