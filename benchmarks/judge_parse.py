"""How many judge replies of tests/judge_replies.py a commit's ``JudgeReward.parse`` reads as a person does.

    python benchmarks/judge_parse.py [--old 26483de]

The old parser is ``JudgeReward.parse`` of the file ``amir_lightning/rewards/judge.py`` at ``--old`` (``git show``),
with its defaults; the new one is this checkout's. A reply is read right when the score (normalised to [0, 1]) is
the one in the table, or when both say there is none.
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


def old_judge(commit: str):
    command = ["git", "show", f"{commit}:amir_lightning/rewards/judge.py"]
    source = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_judge.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_judge", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_judge"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.JudgeReward(url="http://unused:1", max_score=MAX_SCORE)


def shown(value: float | None) -> str:
    return "-" if value is None else f"{value * MAX_SCORE:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="26483de")
    args = parser.parse_args()
    old, new = old_judge(args.old), JudgeReward(url="http://unused:1", max_score=MAX_SCORE)
    right = {"old": 0, "new": 0}
    print(f"| reply | expected | old ({args.old}) | new |\n|---|---|---|---|")
    for reply, expected in REPLIES:
        want = None if expected is None else expected / MAX_SCORE
        got = {"old": old.parse(reply), "new": new.parse(reply)}
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
