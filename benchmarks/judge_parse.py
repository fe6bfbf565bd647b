"""How many judge replies of tests/judge_replies.py a commit's parser reads as a person does.

    python benchmarks/judge_parse.py [--old 26483de]

The old parser is the one at ``--old`` (``git show``): ``parse_score`` of ``amir_lightning/rewards/judge_parse.py``
where the commit has that file, else ``JudgeReward.parse`` of ``amir_lightning/rewards/judge.py`` with its defaults;
the new one is this checkout's. A reply is read right when the score (normalised to [0, 1]) is the one in the
table, or when both say there is none.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from judge_replies import MAX_SCORE, REPLIES  # noqa: E402

from amir_lightning.rewards import JudgeReward  # noqa: E402


def _module_at(commit: str, path: str, name: str):
    """The module of the file ``path`` at ``commit``; ``None`` where the commit has no such file."""
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode != 0:
        return None
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def old_parse(commit: str):
    """The parser at ``commit``: a reply to its score in [0, 1] or ``None``."""
    parsing = _module_at(commit, "amir_lightning/rewards/judge_parse.py", "old_judge_parse")
    if parsing is not None:
        return lambda reply: None if (v := parsing.parse_score(reply, MAX_SCORE)) is None else v / MAX_SCORE
    module = _module_at(commit, "amir_lightning/rewards/judge.py", "old_judge")
    return module.JudgeReward(url="http://unused:1", max_score=MAX_SCORE).parse


def shown(value: float | None) -> str:
    return "-" if value is None else f"{value * MAX_SCORE:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="26483de")
    args = parser.parse_args()
    old, new = old_parse(args.old), JudgeReward(url="http://unused:1", max_score=MAX_SCORE).parse
    right = {"old": 0, "new": 0}
    print(f"| reply | expected | old ({args.old}) | new |\n|---|---|---|---|")
    for reply, expected in REPLIES:
        want = None if expected is None else expected / MAX_SCORE
        got = {"old": old(reply), "new": new(reply)}
        marks = {}
        for which, value in got.items():
            ok = value == want or (value is not None and want is not None and abs(value - want) < 1e-9)
            right[which] += ok
            marks[which] = shown(value) + ("" if ok else " ✗")
        cell = reply.replace("\n", "\\n").replace("|", "\\|")
        print(f"| `{cell}` | {shown(want)} | {marks['old']} | {marks['new']} |")
    print(f"\nread right: old {right['old']}/{len(REPLIES)}, new {right['new']}/{len(REPLIES)}")


if __name__ == "__main__":
    main()
