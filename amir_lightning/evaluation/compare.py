"""``amir compare RUN_A RUN_B ...``: the paper's analyses over the ``eval/*.json`` of several ``amir test`` runs.

- Coverage (Table 2): over the problems solved (at least one correct sample) by at least one run, the share solved
  by each combination of runs, with every solved/unsolved pattern listed.
- Margin distribution (Figure 4): per problem with both correct and incorrect samples, the mean length-normalised
  log-prob (temperature 1, under each run's policy) of its correct samples minus that of its incorrect ones; a
  violin per run, written as PNG.
Writes ``<out>/compare.md`` and ``<out>/margins_<benchmark>.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from amir_lightning.helpers.extras import missing


def load_run(path: Path) -> dict[str, dict]:
    """The benchmark reports of one run: ``path`` is a run directory (with ``eval/``) or the ``eval`` directory."""
    folder = path / "eval" if (path / "eval").is_dir() else path
    reports = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not reports:
        raise FileNotFoundError(f"no benchmark reports (*.json) under {folder}: run `amir test` first")
    return reports


def problem_margins(report: dict) -> list[float]:
    """Per problem with both outcomes: mean log-prob of correct samples minus that of incorrect samples."""
    out = []
    for problem in report["problems"]:
        right = [lp for lp, c in zip(problem["mean_logp"], problem["correct"]) if c]
        wrong = [lp for lp, c in zip(problem["mean_logp"], problem["correct"]) if not c]
        if right and wrong:
            out.append(statistics.fmean(right) - statistics.fmean(wrong))
    return out


def coverage(reports: list[dict]) -> tuple[int, list[tuple[tuple[bool, ...], int]]]:
    """Problems solved by any run, and the count of each solved/unsolved pattern over the runs."""
    solved = [[any(p["correct"]) for p in r["problems"]] for r in reports]
    if len({len(s) for s in solved}) != 1:
        raise ValueError("the runs evaluated different numbers of problems of this benchmark")
    patterns = [tuple(s[i] for s in solved) for i in range(len(solved[0]))]
    relevant = [p for p in patterns if any(p)]
    rows = [(combo, relevant.count(combo)) for combo in itertools.product([True, False], repeat=len(reports))]
    return len(relevant), rows


def violin_plot(path: Path, labels: list[str], margins: list[list[float]], title: str) -> None:
    """A violin of per-problem margins per run (runs with under 2 margins left out), written to ``path``."""
    try:
        import matplotlib
    except ImportError as err:
        raise missing("amir compare (its plots)", "compare") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(labels), 4))
    shown = [(label, m) for label, m in zip(labels, margins) if len(m) >= 2]
    if shown:
        ax.violinplot([m for _, m in shown], showmedians=True)
        for i, (_, m) in enumerate(shown, 1):
            ax.annotate(
                f"{statistics.median(m):.3f}",
                (i, statistics.median(m)),
                textcoords="offset points",
                xytext=(8, 0),
                fontsize=8,
            )
        ax.set_xticks(range(1, len(shown) + 1), [label for label, _ in shown])
    ax.axhline(0.0, linestyle="--", color="grey", linewidth=1)
    ax.set_ylabel("length-normalised log(P) margin")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(runs: list[Path], labels: list[str], out: Path) -> Path:
    """Write ``out/compare.md`` and the margin PNGs for the benchmarks all ``runs`` share; returns the report."""
    loaded = [load_run(r) for r in runs]
    shared = sorted(set.intersection(*(set(r) for r in loaded)))
    if not shared:
        raise ValueError("the runs share no benchmark")
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Run comparison", "", "Runs: " + ", ".join(f"`{label}` ({run})" for label, run in zip(labels, runs)), ""]
    for name in shared:
        reports = [r[name] for r in loaded]
        ks = sorted(reports[0]["pass@k"], key=int)
        lines += [
            f"## {name}",
            "",
            "| run | " + " | ".join(f"pass@{k}" for k in ks) + " | solved |",
            "|---|" + "---|" * (len(ks) + 1),
        ]
        for label, report in zip(labels, reports):
            solved = sum(any(p["correct"]) for p in report["problems"])
            cells = " | ".join(f"{100 * report['pass@k'][k]:.1f}" for k in ks)
            lines.append(f"| {label} | {cells} | {solved}/{len(report['problems'])} |")
        total, rows = coverage(reports)
        lines += [
            "",
            f"Coverage of the {total} problems solved by at least one run:",
            "",
            "| " + " | ".join(labels) + " | coverage | count |",
            "|---" * (len(labels) + 2) + "|",
        ]
        for combo, count in rows:
            marks = " | ".join("✓" if solved else "✗" for solved in combo)
            lines.append(f"| {marks} | {100 * count / max(total, 1):.1f} % | {count} |")
        margins = [problem_margins(r) for r in reports]
        lines += [
            "",
            "Margin (correct minus incorrect, mean token log-prob) over problems with both outcomes:",
            "",
            "| run | problems | mean | median | share > 0 |",
            "|---|---|---|---|---|",
        ]
        for label, m in zip(labels, margins):
            if m:
                share = sum(x > 0 for x in m) / len(m)
                lines.append(
                    f"| {label} | {len(m)} | {statistics.fmean(m):.4f} | {statistics.median(m):.4f} | {share:.2f} |"
                )
            else:
                lines.append(f"| {label} | 0 | - | - | - |")
        png = out / f"margins_{name}.png"
        violin_plot(png, labels, margins, f"{name}: margin of correct over incorrect samples")
        lines += ["", f"![margins]({png.name})", ""]
    report = out / "compare.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``amir compare``."""
    parser = argparse.ArgumentParser(
        prog="amir compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of `amir test` (or their eval/)")
    parser.add_argument("--labels", nargs="+", help="names of the runs in tables and plots (default: paths)")
    parser.add_argument("--out", type=Path, default=Path("compare"), help="output directory")
    args = parser.parse_args(argv)
    labels = args.labels or [str(r) for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    try:
        report = compare(args.runs, labels, args.out)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"amir compare: error: {err}\n")
    sys.stdout.write(f"wrote {report}\n")  # the command's result for the user
