"""The package as users get it: a wheel built from this tree installs into a fresh venv and runs the tiny config."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_a_wheel_built_here_installs_into_a_fresh_venv_and_trains_the_tiny_config(tmp_path):
    """``pip wheel`` builds the wheel (what ``python -m build`` does, without network); a fresh venv takes it with
    the dependencies this suite runs with (a path file, so nothing is downloaded) and nothing of this tree; its
    ``amir`` lists exactly the working subcommands and trains configs/tiny.yaml for 2 rollouts."""
    dist = tmp_path / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist)]
    subprocess.run([*pip_wheel, str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("amir_lightning-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "amir_lightning/callbacks/length_bias.py" in names and "amir_lightning/rewards/judge.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "configs/"))]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    (Path(site) / "amir_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"AMIR_CACHE": str(tmp_path / "cache")}
    run = tmp_path / "run"
    run.mkdir()
    where = subprocess.run([python, "-c", "import amir_lightning; print(amir_lightning.__file__)"], cwd=run, env=env,
                           check=True, capture_output=True, text=True).stdout  # fmt: skip
    assert where.startswith(str(venv))  # the wheel's copy, not this tree
    helped = subprocess.run([venv / "bin" / "amir", "--help"], cwd=run, env=env, capture_output=True, text=True)
    shown = " ".join(helped.stdout.split())  # argparse wraps the description
    assert "{fit,validate,test}" in shown and "`amir compare RUN_DIR ...`" in shown and "predict" not in shown
    config = str(ROOT / "configs" / "tiny.yaml")
    fit = subprocess.run([venv / "bin" / "amir", "fit", "--config", config, "--trainer.max_epochs", "2"], cwd=run,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "rollout 2 of 2" in fit.stdout + fit.stderr and (run / "runs" / "tiny" / "version_0" / "policy").is_dir()
