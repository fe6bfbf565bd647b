"""GRPO against AMIR-GRPO on CPU tasks with reward variance: the same budget, several seeds, curves with seed bands.

    python benchmarks/learning.py --task tiny --seeds 3      # tiny Qwen2 from scratch, digit copy (~20 s a run)
    python benchmarks/learning.py --task demo --seeds 3      # bundled SmolLM2, easy arithmetic (~10 min a run)

Each run is ``amir fit --config configs/<task>[_grpo].yaml`` with ``--seed_everything`` and ``--data.seed`` set to
the seed (and the tiny model's init seed), and ``--data.shuffle false``, so every seed trains on the same prompt
sequence; the twins differ only in the objective. The script prints the settings
(lambda, beta, margin), a table of final reward and held-out accuracy (mean and range over seeds), the first step at
which each method reaches GRPO's final mean accuracy, and writes ``<out>/learning_<task>.png``: rollout reward,
held-out accuracy, pair margin and the length gap of incorrect minus correct completions, mean with min-max band.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["rollout/reward_mean", "val/accuracy", "amir/pair_margin", "length/gap"]
VAL_EVERY = {"tiny": 5, "demo": 4}  # held-out accuracy before training and every this many epochs


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def logger_args(out: Path, name: str) -> list[str]:
    """Arguments that put a run's logs in ``<out>/runs/<name>/version_0``."""
    return [
        "--trainer.logger.init_args.save_dir",
        str(out / "runs"),
        "--trainer.logger.init_args.name",
        name,
        "--trainer.logger.init_args.version",
        "0",
    ]


def run(task: str, method: str, seed: int, out: Path) -> dict[str, list[tuple[int, float]]]:
    config = ROOT / "configs" / f"{task}{'_grpo' if method == 'GRPO' else ''}.yaml"
    name = f"{task}_{method.replace(' ', '_')}_seed{seed}"
    log_dir = out / "runs" / name / "version_0"
    if not (log_dir / "cost.json").exists():  # a finished run is reused; an interrupted one starts over
        shutil.rmtree(log_dir, ignore_errors=True)
        args = [
            sys.executable,
            "-m",
            "amir_lightning",
            "fit",
            "--config",
            str(config),
            "--seed_everything",
            str(seed),
            "--data.seed",
            str(seed),
            # every seed trains on the same prompt sequence, as in the tables of docs/benchmarks.md
            "--data.shuffle",
            "false",
            *logger_args(out, name),
        ]
        args += ["--validate_before_fit", "true", "--trainer.check_val_every_n_epoch", str(VAL_EVERY[task])]
        if task == "tiny":
            args += ["--model.policy.init_args.seed", str(seed)]
        if method.startswith("AMIR-GRPO lambda="):  # the pair term at a fixed, larger weight
            lam = method.split("=", 1)[1]
            args += ["--model.loss.init_args.pair_weight.value", lam]
            args += ["--model.loss.init_args.pair_weight.schedule", "fixed"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = out / "runs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with log.open("w") as sink:
            child = subprocess.Popen(args, env=env, cwd=out, stdout=sink, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(child.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name} failed (exit {os.waitstatus_to_exitcode(status)}); its output is in {log}")
        # Linux reports ru_maxrss in KiB: the peak of the run's largest process (vLLM runs in-process).
        cost = {"wall_s": time.perf_counter() - start, "peak_rss_mib": usage.ru_maxrss / 1024}
        (log_dir / "cost.json").write_text(json.dumps(cost))
    return scalars(log_dir)


def cost(out: Path, task: str, method: str, seed: int) -> dict:
    path = out / "runs" / f"{task}_{method.replace(' ', '_')}_seed{seed}" / "version_0" / "cost.json"
    return json.loads(path.read_text()) if path.exists() else {}


def settings(task: str) -> dict:
    """The AMIR loss's settings in the task's config, with the defaults it leaves out."""
    from dataclasses import asdict

    from amir_lightning.objectives.amir import PairTermSettings, PairWeightSettings

    given = yaml.safe_load((ROOT / "configs" / f"{task}.yaml").read_text())["model"]["loss"]["init_args"]
    out = {"aggregation": given.get("aggregation", "grpo"), "kl_coef": given.get("kl_coef", 0.0)}
    out["pair_term"] = asdict(PairTermSettings(**given.get("pair_term", {})))
    out["pair_weight"] = asdict(PairWeightSettings(**given.get("pair_weight", {})))
    return out


def band(runs: list[dict], key: str):
    import numpy as np

    series = [dict(r.get(key, [])) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series and all(series) else []
    values = np.array([[s[t] for t in steps] for s in series]) if steps else np.zeros((0, 0))
    return steps, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["tiny", "demo"], default="tiny")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--fixed-lambda",
        type=float,
        nargs="*",
        default=[],
        help="also run AMIR-GRPO with the pair term at these fixed weights (the config's schedule is adaptive)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loss = settings(args.task)
    methods = ["GRPO", "AMIR-GRPO", *(f"AMIR-GRPO lambda={lam:g}" for lam in args.fixed_lambda)]
    runs = {m: [run(args.task, m, s, args.out) for s in range(args.seeds)] for m in methods}
    print(
        f"task {args.task}, {args.seeds} seeds per method, same budget; AMIR settings: "
        + ", ".join(f"{k}={v}" for k, v in loss.items())
    )
    print(
        "| method | final reward (mean, min-max) | final held-out accuracy (mean, min-max) | "
        "reach GRPO's final accuracy (first step) | longest run, min | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|")
    _, grpo_acc = band(runs["GRPO"], "val/accuracy")
    target = float(grpo_acc[:, -1].mean()) if grpo_acc.size else float("nan")
    for method, rs in runs.items():
        _, reward = band(rs, "rollout/reward_mean")
        steps, acc = band(rs, "val/accuracy")
        tail = reward[:, -3:].mean(1)  # last three rollouts per seed
        reached = [
            t for t in (next((t for t, v in zip(steps, row) if v >= target), None) for row in acc) if t is not None
        ]
        reached = f"{len(reached)}/{len(acc)} seeds, steps {sorted(reached)}" if reached else f"0/{len(acc)} seeds"
        costs = [cost(args.out, args.task, method, s) for s in range(args.seeds)]
        wall = max((c.get("wall_s", float("nan")) for c in costs), default=float("nan")) / 60
        rss = max((c.get("peak_rss_mib", float("nan")) for c in costs), default=float("nan"))
        print(
            f"| {method} | {tail.mean():.3f} ({tail.min():.3f}-{tail.max():.3f}) | {acc[:, -1].mean():.3f} "
            f"({acc[:, -1].min():.3f}-{acc[:, -1].max():.3f}) | {reached} | {wall:.1f} | {rss:.0f} |"
        )
    png = args.out / f"learning_{args.task}.png"
    plot(runs, png, args.task)
    print(f"\nplot: {png}")


def plot(runs: dict, path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(KEYS), figsize=(4.2 * len(KEYS), 3.4))
    for ax, key in zip(axes, KEYS):
        for method, rs in runs.items():
            steps, values = band(rs, key)
            if not steps:
                continue
            ax.plot(steps, values.mean(0), label=method)
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("optimisation step")
    axes[0].legend()
    fig.suptitle(f"GRPO vs AMIR-GRPO on {task} (mean, min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
