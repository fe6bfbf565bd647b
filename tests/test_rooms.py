"""The package's rooms (``amir_lightning/loop``, ``engines``, ``environments``) and the doors users go through.

Every class path the README and the shipped configs name resolves; every module path of the layout before the rooms
(``amir_lightning.rollout.vllm_engine``...) is the module at its new home; and a new engine or environment is one
file outside the package, trained with through ``amir fit``.
"""

import importlib
import re
from pathlib import Path

import pytest
from conftest import HF_ENGINE, read_scalars, run_here

ROOT = Path(__file__).parents[1]


def named_paths() -> set[str]:
    """The dotted paths of the package the README and the configs name (``class_path``, tools, callbacks)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "configs").glob("*.yaml"))]
    return {m for path in texts for m in re.findall(r"\bamir_lightning(?:\.\w+)+", path.read_text())}


def resolve(path: str):
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(path)


def test_every_class_path_the_readme_and_the_configs_name_resolves():
    paths = named_paths()
    assert {"amir_lightning.engines.VLLMEngine", "amir_lightning.environments.CalculatorEnvironment"} <= paths
    unresolved = []
    for path in sorted(paths):
        try:
            resolve(path)
        except (ImportError, AttributeError) as err:
            unresolved.append(f"{path}: {err}")
    assert not unresolved, "\n".join(unresolved)


def test_the_old_layouts_paths_are_the_modules_and_classes_at_their_new_homes():
    import amir_lightning.rollout as old
    from amir_lightning import engines, environments

    assert len(old.MOVED) == 31
    for name, home in old.MOVED.items():
        assert importlib.import_module(f"amir_lightning.rollout.{name}") is importlib.import_module(
            f"amir_lightning.{home}"
        ), name
    assert old.VLLMEngine is engines.VLLMEngine and old.ToolEnvironment is environments.ToolEnvironment
    assert resolve("amir_lightning.rollout.vllm_engine.VLLMEngine") is engines.VLLMEngine
    assert resolve("amir_lightning.rollout.calculator.calculator") is resolve(
        "amir_lightning.environments.calculator.calculator"
    )
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("amir_lightning.rollout.no_such_module")


def test_a_room_imports_nothing_of_the_rooms_above_it():
    """engines <- environments <- loop: an engine knows no environment or loop, an environment no loop."""
    from test_imports import imports_of

    above = {"engines": ("environments", "loop", "systems"), "environments": ("loop", "systems"), "loop": ("systems",)}
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for room, higher in above.items()
        for path in (ROOT / "amir_lightning" / room).rglob("*.py")
        for module in imports_of(path)
        if module.startswith(tuple(f"amir_lightning.{h}" for h in higher))
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_a_new_engine_and_a_new_environment_are_one_file_each(tmp_path, monkeypatch, capsys, caplog):
    """``helpers/toy_engine.py`` samples by hand through the engine seam, ``helpers/toy_environment.py`` answers
    turns through the environment seam: two rollouts of ``configs/tiny.yaml`` train with each, and nothing of the
    package knows them."""
    base = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_epochs", "2"]
    base += ["--data.sampling.max_new_tokens", "4", "--trainer.check_val_every_n_epoch", "100"]
    toy_engine = ["--data.engine", "helpers.toy_engine.ToyEngine"]
    toy_environment = ["--data.environment", "helpers.toy_environment.Doubler"]
    for name, extra in [("engine", toy_engine), ("environment", [*HF_ENGINE, *toy_environment])]:
        run_here([*base, *extra, "--trainer.logger.init_args.name", name], tmp_path, monkeypatch, capsys, caplog)
        scalars = read_scalars(tmp_path / "runs" / name)
        assert len(scalars["train/loss"]) == 2 and max(scalars["rollout/sync_logp_diff"]) < 1e-4
    assert len(read_scalars(tmp_path / "runs" / "environment")["tools/calls"]) == 2
    for path in ("tests/helpers/toy_engine.py", "tests/helpers/toy_environment.py"):
        imported = {m for m in re.findall(r"^from (amir_lightning[\w.]*) import", (ROOT / path).read_text(), re.M)}
        assert imported <= {"amir_lightning.engines", "amir_lightning.engines.base", "amir_lightning.environments"}
    package = "\n".join(p.read_text() for p in (ROOT / "amir_lightning").rglob("*.py"))
    assert "ToyEngine" not in package and "Doubler" not in package
