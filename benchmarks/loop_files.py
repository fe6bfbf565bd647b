"""Which library files and functions one rollout runs through: the size of "the loop" a reader has to follow.

    python benchmarks/loop_files.py

Runs ``configs/tiny.yaml`` (real vLLM, the math reward, AMIR-GRPO) for two rollouts in this process and records,
with ``sys.setprofile``, every Python function of ``amir_lightning/`` and ``callbacks/`` called from the end of the
first rollout to the end of the second: the weight sync, generation, rewards, advantages, the steps and the
monitors. Checkpoints are not written and validation is off. Work in the reward's grading processes is not traced
(it runs in other processes); ``rewards/sandbox.py`` shows up as the caller that hands it over.
Prints the files (library, then monitors) with how many of their functions ran (comprehensions and lambdas
count as part of the function around them).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY, MONITORS = ROOT / "amir_lightning", ROOT / "callbacks"
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")  # parts of the function around them


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lightning.pytorch.callbacks import Callback

    from amir_lightning.cli import main as amir

    seen: dict[Path, set[str]] = defaultdict(set)

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        name = frame.f_code.co_qualname
        if (path.is_relative_to(LIBRARY) or path.is_relative_to(MONITORS)) and not name.endswith(INLINE):
            seen[path].add(name)

    class Trace(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 0:
                sys.setprofile(profile)
                threading.setprofile(profile)
            else:
                sys.setprofile(None)
                threading.setprofile(None)

    Trace.__module__ = "__main__"
    sys.modules["__main__"].Trace = Trace  # for class_path: __main__.Trace
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        os.environ["AMIR_CACHE"] = str(Path(folder) / "cache")
        amir(
            ["fit", "--config", str(ROOT / "configs/tiny.yaml"), "--trainer.max_epochs", "2",
             "--checkpoint.save_on_train_epoch_end", "false", "--trainer.check_val_every_n_epoch", "100",
             "--trainer.callbacks+", "__main__.Trace", "--model.export.dir", str(Path(folder) / "policy")]
        )  # fmt: skip
    for title, root in (("library", LIBRARY), ("monitors", MONITORS)):
        files = sorted((p for p in seen if p.is_relative_to(root)), key=lambda p: str(p))
        print(f"\n{title}: {len(files)} files, {sum(len(seen[p]) for p in files)} functions")
        for path in files:
            print(f"  {path.relative_to(ROOT)!s:48} {len(seen[path]):3d}  {', '.join(sorted(seen[path]))[:150]}")


if __name__ == "__main__":
    main()
