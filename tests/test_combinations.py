"""The combinations users make (``tests/helpers/combinations.py``): each of the 144 cells is refused at start in one
line naming its keys, or trains exactly. Every cell is built; the cells that hold every pair of two settings' values
among those that train (9) run end to end twice: uninterrupted, and resumed from the checkpoint after rollout 2.
``python benchmarks/combinations.py --cells all`` runs every cell that trains (docs/architecture.md has the table).
"""

import os
import sys
from pathlib import Path

import pytest
from conftest import run_amir
from helpers.combinations import LORA_RANK, every_cell, pairwise, train_and_resume

from amir_lightning.cli import main
from amir_lightning.cli.app import build_cli

pytestmark = pytest.mark.slow
HELPERS = Path(__file__).parent / "helpers"
CELLS = every_cell()
TRAINED = pairwise([cell for cell in CELLS if cell.refusal() is None])


@pytest.mark.parametrize("cell", CELLS, ids=[cell.id for cell in CELLS])
def test_each_cell_is_refused_at_start_in_one_line_naming_its_keys_or_built(cell, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HELPERS))  # tools.Echo
    monkeypatch.setenv("AMIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AMIR_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["amir"])
    refusals = cell.refusal()
    if refusals is None:
        build_cli(cell.args(None)[1:], run=False)  # the module, the data module and the trainer, as fit builds them
        return
    with pytest.raises(SystemExit) as exit_info:
        main(cell.args(None))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("amir: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for keys in refusals:
        assert all(key in lines[0] for key in keys), (keys, lines[0])


@pytest.mark.parametrize("cell", TRAINED, ids=[cell.id for cell in TRAINED])
def test_a_cell_trains_exactly_and_resumes_to_the_same_weights(cell, tmp_path, served):
    """3 rollouts on configs/tiny.yaml: every sync verified (read back exactly, the probe within float32 noise), no
    two groups of one prompt alike over rollouts and processes, every step's normalisers its loss masks' sums (an
    environment's replies left out), dr_grpo's L the episode's token limit; resumed from the checkpoint after rollout
    2, the run ends with the uninterrupted run's weights, bitwise. The cells ahead share a server (``served``), the
    adapter cells one that serves adapters: each later run finds the adapters the earlier one left there."""
    rank = LORA_RANK if cell.lora == "adapters" else None  # a server that serves adapters, where they are pushed
    engine = served.tiny_yaml_engine(rank) if cell.schedule != "in turn" else None
    env = dict(os.environ, PYTHONPATH=str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    found = train_and_resume(cell, tmp_path, engine, lambda args, folder: run_amir(args, folder, env=env))
    assert found["rollouts"] == 3 and found["verified"] > 0 and found["probe_gap"] < 1e-4, found
    assert found["copies"] == [] and (found["replies"] > 0) == cell.episodes, found
    assert found["differs"] is None, found
