"""Every module imports; importing the package never imports vLLM."""

import importlib
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import amir_lightning
import amir_lightning.callbacks

ROOT = Path(__file__).parents[1]


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(amir_lightning.__path__, "amir_lightning.")]
    names += [m.name for m in pkgutil.walk_packages(amir_lightning.callbacks.__path__, "amir_lightning.callbacks.")]
    assert "amir_lightning.objectives.amir" in names
    for name in names:
        if name != "amir_lightning.__main__":
            importlib.import_module(name)


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "amir_lightning." + ".".join(p.parent.relative_to(ROOT / "amir_lightning").parts)
        for p in (ROOT / "amir_lightning").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found} | {"amir_lightning.callbacks"}
    assert listed == found


@pytest.mark.slow
def test_package_import_does_not_import_vllm():
    code = "import sys, amir_lightning.cli, amir_lightning.rollout, amir_lightning.module; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
