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
def test_package_import_does_not_import_vllm_or_verifiers():
    modules = "amir_lightning.cli, amir_lightning.rollout, amir_lightning.systems, amir_lightning.data"
    code = f"import sys, {modules}; print('vllm' in sys.modules, 'verifiers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"  # each is imported by what uses it (an engine, an environment)


#: The package's parts, lowest first: a part imports only from its own tier and those below it. helpers are used
#: everywhere; rollout/ and evaluation/ stay free of Lightning, models/ too; the Lightning systems sit on top.
TIERS = [
    {"helpers"},
    {"data", "models", "rewards", "objectives"},
    {"engines"},
    {"environments"},
    {"loop"},
    {"rollout"},
    {"evaluation"},
    {"checkpoints"},
    {"systems"},
    {"cli", "__main__", "vllm_serve"},
]
FREE_OF_LIGHTNING = {
    "helpers",
    "data",
    "models",
    "rewards",
    "objectives",
    "engines",
    "environments",
    "rollout",
    "evaluation",
}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def part_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "amir_lightning" and len(parts) > 1 else None


def test_parts_depend_one_way_and_the_lower_ones_never_import_lightning():
    tier = {part: level for level, parts in enumerate(TIERS) for part in parts}
    files = [p for p in (ROOT / "amir_lightning").rglob("*.py")]
    assert {p.relative_to(ROOT / "amir_lightning").parts[0].removesuffix(".py") for p in files} - {"__init__"} == set(
        tier
    ), "every file of the package belongs to a part"
    wrong = []
    for path in files:
        own = path.relative_to(ROOT / "amir_lightning").parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        for module in imports_of(path):
            other = part_of(module)
            if other == "callbacks" or (other in tier and tier[other] > tier[own]):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
            if own in FREE_OF_LIGHTNING and module.split(".")[0] == "lightning":
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other_even_for_type_hints():
    """A cycle of imports (a type hint included) means two files that cannot be read apart: none is allowed."""
    files = {module_name(p): p for p in (ROOT / "amir_lightning").rglob("*.py") if p.name != "__init__.py"}
    graph = {name: {m for m in imports_of(path) if m in files and m != name} for name, path in files.items()}
    cycles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(" -> ".join([*path[path.index(name) :], name]))
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "\n".join(cycles)
