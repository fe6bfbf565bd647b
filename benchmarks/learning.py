"""GRPO against AMIR-GRPO on CPU tasks with reward variance: the same budget, several seeds, curves with seed bands.

    python benchmarks/learning.py --task tiny --seeds 3      # tiny Qwen2 from scratch, digit copy (~4 min)
    python benchmarks/learning.py --task demo --seeds 3      # bundled SmolLM2, easy arithmetic (~50 min)

Each run is ``amir fit --config configs/<task>[_grpo].yaml`` with ``--seed_everything`` and ``--data.seed`` set to
the seed (and the tiny model's init seed); the twins differ only in the objective. The script prints the settings
(lambda, beta, margin), a table of final reward and held-out accuracy (mean and range over seeds), the first step at
which each method reaches GRPO's final mean accuracy, and writes ``<out>/learning_<task>.png``: rollout reward,
held-out accuracy, pair margin and the length gap of incorrect minus correct completions, mean with min-max band.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["rollout/reward_mean", "val/accuracy", "amir/pair_margin", "length/gap"]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def run(task: str, method: str, seed: int, out: Path) -> dict[str, list[tuple[int, float]]]:
    config = ROOT / "configs" / f"{task}{'_grpo' if method == 'GRPO' else ''}.yaml"
    name = f"{task}_{method}_seed{seed}"
    log_dir = out / "runs" / name / "version_0"
    if not log_dir.exists():
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
            "--trainer.logger.init_args.save_dir",
            str(out / "runs"),
            "--trainer.logger.init_args.name",
            name,
            "--trainer.logger.init_args.version",
            "0",
        ]
        if task == "tiny":
            args += ["--model.policy.init_args.seed", str(seed)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        subprocess.run(args, check=True, env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return scalars(log_dir)


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
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loss = yaml.safe_load((ROOT / "configs" / f"{args.task}.yaml").read_text())["model"]["loss"]["init_args"]
    runs = {m: [run(args.task, m, s, args.out) for s in range(args.seeds)] for m in ("GRPO", "AMIR-GRPO")}
    print(
        f"task {args.task}, {args.seeds} seeds per method, same budget; AMIR settings: "
        + ", ".join(f"{k}={v}" for k, v in loss.items())
    )
    print(
        "| method | final reward (mean, min-max) | final held-out accuracy (mean, min-max) | "
        "first step at GRPO's final accuracy (per seed) |"
    )
    print("|---|---|---|---|")
    _, grpo_acc = band(runs["GRPO"], "val/accuracy")
    target = float(grpo_acc[:, -1].mean()) if grpo_acc.size else float("nan")
    for method, rs in runs.items():
        _, reward = band(rs, "rollout/reward_mean")
        steps, acc = band(rs, "val/accuracy")
        tail = reward[:, -3:].mean(1)  # last three rollouts per seed
        reached = [next((t for t, v in zip(steps, row) if v >= target), None) for row in acc]
        print(
            f"| {method} | {tail.mean():.3f} ({tail.min():.3f}-{tail.max():.3f}) | {acc[:, -1].mean():.3f} "
            f"({acc[:, -1].min():.3f}-{acc[:, -1].max():.3f}) | {reached} |"
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
