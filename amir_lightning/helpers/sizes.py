"""Sizes in bytes as the run's messages print them (memory plans, checkpoint space)."""

from __future__ import annotations

GIB = 2**30


def format_bytes(count: float) -> str:
    """A size in GiB, or in MiB below a tenth of one."""
    return f"{count / GIB:.1f} GiB" if count >= GIB / 10 else f"{count / 2**20:.1f} MiB"
