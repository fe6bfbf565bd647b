"""Generation overlapped with training: the colocated engine, the server engine, and the server a rollout ahead.

    python benchmarks/overlap.py --setting demo --seeds 0 1 2     # configs/demo.yaml: 12 rollouts, held-out accuracy
    python benchmarks/overlap.py --setting long --seeds 0         # generation-heavy: 3 terms, 128 new tokens, 5
                                                                  # rollouts, timing only (no validation)
    python benchmarks/overlap.py --setting tiny --seeds 0         # the tiny model, a minute: checks the script

Three arms on the same task and seeds, one after another:

- ``colocated``: ``VLLMEngine`` in the training process (today's default): generation, then training;
- ``server``: ``VLLMServerEngine``, generation then training (``data.rollout.max_staleness 0``);
- ``server_async``: the same server, the next rollout sampling while the policy trains (``max_staleness 1``), with
  exact old log-probs (``stale_logps: sampler``: one more forward pass);
- ``server_async_current`` (``--arms``): the same, with ``stale_logps: current`` (the default; no pass for the old
  log-probs);
- ``aheadN_inflight`` (``--arms``, N = 1, 2, 4, ...): ``max_staleness N`` with ``partial_rollouts true`` and
  ``stale_logps: current``: N rollouts sampling while the policy trains, each push reaching them in flight; these
  arms checkpoint only after the last rollout (a checkpoint waits for the rollouts in flight), and the table adds
  their staleness (mean and max over tokens), the share of completions a push reached and of tokens whose
  engine/trainer weight the cap truncated (``train/is_capped_frac``).

On a 2-core machine the training process is pinned to core 0 (``taskset -c 0``) and the server to core 1
(``cpu_cores: "1"``), each with one thread; the colocated arm runs in one process on core 0. Per arm the script
prints the median wall seconds per rollout (the time between consecutive rollouts, the first and the validation
rollouts left out), generation and training seconds per rollout, generation and training tokens/s, the trainer's
wait for a rollout sampled ahead, and the held-out accuracy after the last rollout (mean and range over seeds).
``max(gen, train)`` is the best an overlap can do: ``server_async``'s wall time against it says how close it gets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learning import logger_args, scalars  # noqa: E402

SETTINGS = {
    "demo": ["--config", str(ROOT / "configs" / "demo.yaml")],
    "long": [
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--data.prompts.init_args.num_terms",
        "3",
        "--data.prompts.init_args.template",
        "What is {expression}? Think step by step, then give the answer as \\boxed{N}.",
        "--data.val_prompts.init_args.num_terms",
        "3",
        "--data.val_prompts.init_args.template",
        "What is {expression}? Think step by step, then give the answer as \\boxed{N}.",
        "--data.sampling.max_new_tokens",
        "128",
        "--data.evaluation.val_sampling.max_new_tokens",
        "128",
        "--data.rollout.drop_zero_std_groups",
        "true",
        "--trainer.max_epochs",
        "5",
        "--validate_before_fit",
        "false",
        "--trainer.limit_val_batches",
        "0",
        "--data.engine.init_args.max_model_len",
        "320",
    ],
    "tiny": ["--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "8"],
}
ENGINE_LEN = {"demo": 256, "long": 320, "tiny": 64}
KV_CACHE = {"demo": 268435456, "long": 268435456, "tiny": 33554432}


def engine_args(arm: str, setting: str) -> list[str]:
    if arm == "colocated":
        return []
    init = {"max_model_len": ENGINE_LEN[setting], "kv_cache_memory_bytes": KV_CACHE[setting], "threads": 1}
    if len(os.sched_getaffinity(0)) > 1:
        init["cpu_cores"] = "1"
    engine = json.dumps({"class_path": "amir_lightning.engines.VLLMServerEngine", "init_args": init})
    staleness = ["--data.rollout.max_staleness", "1"] if arm.startswith("server_async") else []
    if arm.startswith("server_async"):
        staleness += ["--data.rollout.stale_logps", "current" if arm == "server_async_current" else "sampler"]
    if arm.startswith("ahead") and arm.endswith("_inflight"):
        depth = arm.removeprefix("ahead").removesuffix("_inflight")
        staleness += ["--data.rollout.max_staleness", depth, "--data.rollout.partial_rollouts", "true"]
        staleness += ["--data.rollout.stale_logps", "current", "--checkpoint.every_n_epochs", "1000"]
    return ["--data.engine", engine, *staleness]


def run(setting: str, arm: str, seed: int, out: Path) -> dict:
    name = f"{setting}_{arm}_seed{seed}"
    log_dir = out / "runs" / name / "version_0"
    if not (log_dir / "done").exists():
        shutil.rmtree(log_dir, ignore_errors=True)
        args = [*SETTINGS[setting], *engine_args(arm, setting), "--seed_everything", str(seed)]
        args += ["--data.seed", str(seed), "--model.export.dir", str(out / "exports" / name), *logger_args(out, name)]
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") and len(os.sched_getaffinity(0)) > 1 else []
        command = [*pin, sys.executable, "-m", "amir_lightning", "fit", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        print(f"{name}: {' '.join(command[-6:])} ...", flush=True)
        with (out / f"{name}.log").open("w") as log:
            subprocess.run(command, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        (log_dir / "done").write_text("")
    return summarise(log_dir)


def summarise(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times = []
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "rollout/reward_mean" in acc.Tags()["scalars"]:
            times += [e.wall_time for e in acc.Scalars("rollout/reward_mean")]
    logged = scalars(log_dir)
    validated = {step for step, _ in logged.get("val/accuracy", [])}

    def values(key: str) -> list[float]:
        return [v for _, v in logged.get(key, [])]

    gaps = [b - a for a, b in zip(times, times[1:])]
    # a gap that holds a validation pass is left out (the rollouts' own pace is measured)
    steps = [s for s, _ in logged["rollout/reward_mean"]]
    gaps = [g for g, s in zip(gaps, steps[1:]) if not any(steps[0] < v <= s for v in validated)] or gaps
    train_s = values("throughput/train_s")
    generate_s = values("rollout/generate_s")
    return {
        "wall_s": statistics.median(gaps) if gaps else float("nan"),
        "generate_s": statistics.median(generate_s[1:] or generate_s),
        "train_s": statistics.median(train_s[1:] or train_s),
        "wait_s": statistics.median(values("rollout/wait_s")[1:] or [0.0]),
        "gen_tok_s": statistics.median(values("rollout/tokens_per_s")[1:] or [float("nan")]),
        "train_tok_s": statistics.median(values("throughput/train_tokens_per_s")[1:] or [float("nan")]),
        "accuracy": values("val/accuracy"),
        "rollouts": len(values("rollout/reward_mean")),
        "staleness": statistics.mean(values("rollout/staleness_steps")[1:] or [0.0]),
        "staleness_max": max(values("rollout/staleness_steps_max") or [0.0]),
        "spanning": statistics.mean(values("rollout/spanning_frac")[1:] or [0.0]),
        "capped": statistics.mean(values("train/is_capped_frac")[1:] or [0.0]),
    }


def table(setting: str, results: dict[str, list[dict]]) -> str:
    lines = [
        f"setting {setting}; medians over rollouts, then the mean over seeds; accuracy: held-out, before -> last "
        "(mean, min-max over seeds)",
        "",
        "| arm | seeds | wall s / rollout | generate s | train s | max(gen, train) | trainer wait s | gen tok/s "
        "| train tok/s | staleness mean / max | completions a push reached | tokens capped | held-out accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, runs in results.items():
        if not runs:
            continue

        def mean(key: str, runs=runs) -> float:
            return statistics.mean(r[key] for r in runs)

        first = [r["accuracy"][0] for r in runs if r["accuracy"]]
        last = [r["accuracy"][-1] for r in runs if r["accuracy"]]
        acc = (
            f"{statistics.mean(first):.3f} -> {statistics.mean(last):.3f} ({min(last):.3f}-{max(last):.3f})"
            if last
            else "-"
        )
        bound = max(mean("generate_s"), mean("train_s"))
        lines.append(
            f"| {arm} | {len(runs)} | {mean('wall_s'):.1f} | {mean('generate_s'):.1f} | {mean('train_s'):.1f} | "
            f"{bound:.1f} | {mean('wait_s'):.2f} | {mean('gen_tok_s'):.0f} | {mean('train_tok_s'):.0f} | "
            f"{mean('staleness'):.2f} / {max(r['staleness_max'] for r in runs):.0f} | {mean('spanning'):.2f} | "
            f"{mean('capped'):.3f} | {acc} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--arms", nargs="+", default=["colocated", "server", "server_async"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "overlap")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            results[arm].append(run(args.setting, arm, seed, args.out))
            print(table(args.setting, results), flush=True)
    report = table(args.setting, results)
    (args.out / f"overlap_{args.setting}.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
