"""Every combination users make, run through ``amir fit`` on configs/tiny.yaml: refused at start, or trained exactly.

The cells (``tests/helpers/combinations.py``): in turn / 1 ahead / 2 ahead with pushes in flight, 1 or 2 processes
(FSDP2), LoRA none / merged pushes / adapter pushes, multi-turn episodes or not, dynamic sampling or not, dr_grpo or
dapo. A refused cell must stop with exit 2 and one line naming its keys; a cell that trains runs 3 rollouts, then
again from its checkpoint after rollout 2, and must keep every invariant (every sync read back exactly, no two
groups of one prompt alike, the normalisers the policy's tokens, the resumed run's weights the uninterrupted run's,
bitwise). Prints one row per cell and a summary; exits 1 if any cell broke.

    python benchmarks/combinations.py                  # the 9 cells that cover every pair of settings' values
    python benchmarks/combinations.py --cells all      # all 144 (about 2 hours on 2 cores)
    python benchmarks/combinations.py --cells ahead2-2p-none-dynamic-dapo,inturn-1p-none-dr_grpo
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path.insert(0, str(HELPERS.parent))

from helpers.combinations import LORA_RANK, Cell, every_cell, pairwise, train_and_resume  # noqa: E402
from helpers.served import Served  # noqa: E402

ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    TOKENIZERS_PARALLELISM="false",
    OMP_NUM_THREADS="1",
    TORCHDYNAMO_DISABLE="1",
    PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""),
)


def amir(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    """``amir`` in a process of its own in ``folder``."""
    env = ENV | {"AMIR_CACHE": str(folder / "cache")}
    command = [sys.executable, "-m", "amir_lightning", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)


def must_run(args: list[str], folder: Path) -> None:
    """``amir``, which must succeed."""
    result = amir(args, folder)
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1]}")


def refused(cell: Cell, folder: Path) -> str:
    """How ``cell``'s refusal reads: ``ok: <the line>`` when it is one line naming the keys, else what is wrong."""
    result = amir(cell.args(None), folder)
    lines = [line for line in result.stderr.splitlines() if line.startswith("amir: error:")]
    if result.returncode != 2 or len(lines) != 1 or "Traceback" in result.stderr:
        return f"BROKEN: exit {result.returncode}, {len(lines)} error line(s)"
    missing = [key for keys in cell.refusal() for key in keys if key not in lines[0]]
    return f"BROKEN: the line does not name {missing}" if missing else "ok: " + lines[0][len("amir: error: ") :]


def trained(cell: Cell, folder: Path, served: Served) -> str:
    """How ``cell`` trains: ``ok`` with its figures when every invariant holds, else the first that broke."""
    rank = LORA_RANK if cell.lora == "adapters" else None  # adapter pushes need a server that serves adapters
    engine = served.tiny_yaml_engine(rank) if cell.schedule != "in turn" else None
    try:
        found = train_and_resume(cell, folder, engine, must_run)
    except Exception as err:  # a run that failed: its last line
        return f"BROKEN: {err}"
    broken = [
        f"{found['rollouts']} rollouts logged" if found["rollouts"] != 3 else "",
        "a sync not read back" if not found["verified"] > 0 else "",
        f"probe gap {found['probe_gap']:.2g}" if not found["probe_gap"] < 1e-4 else "",
        f"copied groups: {found['copies'][0]}" if found["copies"] else "",
        "no environment replies" if cell.episodes and not found["replies"] else "",
        f"resumed weights differ at {found['differs']}" if found["differs"] else "",
    ]
    broken = [b for b in broken if b]
    if broken:
        return "BROKEN: " + "; ".join(broken)
    return (
        f"ok: {found['verified']:.0f}+ tensors read back a sync, probe gap <= {found['probe_gap']:.1e}, "
        f"{found['replies']} reply tokens left out, resumed bitwise"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="pairwise", help="pairwise, all, or cell ids separated by commas")
    options = parser.parse_args()
    cells = every_cell()
    if options.cells == "pairwise":
        accepted = [cell for cell in cells if cell.refusal() is None]
        cells = pairwise(accepted) + [cell for cell in cells if cell.refusal() is not None]
    elif options.cells != "all":
        wanted = options.cells.split(",")
        cells = [cell for cell in cells if cell.id in wanted]
    print("| cell | outcome | seconds |\n|---|---|---|", flush=True)
    broken = 0
    with tempfile.TemporaryDirectory(prefix="amir-combinations-") as scratch:
        served = Served(Path(scratch) / "served")
        try:
            for index, cell in enumerate(cells):
                folder = Path(scratch) / str(index)
                folder.mkdir()
                start = time.perf_counter()
                outcome = (
                    "refused " + refused(cell, folder) if cell.refusal() else "trained " + trained(cell, folder, served)
                )
                broken += "BROKEN" in outcome
                print(f"| {cell.name} | {outcome} | {time.perf_counter() - start:.0f} |", flush=True)
        finally:
            served.close()
    print(f"\n{len(cells)} cells: {len(cells) - broken} held, {broken} broke", flush=True)
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
