"""Atomic file and directory writes: a half-written checkpoint or export is never picked up."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; on success put it in place of ``target`` by renaming.

    With ``replace=False`` (caches several processes may fill at once) an existing ``target`` wins: the new
    directory is discarded, so a reader never finds the target missing or half-written.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is a shared cache or an export
    try:
        yield tmp
        if target.exists() and not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.replace(tmp, target)
            except OSError:  # another process put its copy there first
                if replace or not target.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
