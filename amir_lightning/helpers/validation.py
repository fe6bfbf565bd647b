"""Range checks of numeric configuration values: each names its config key, and NaN or infinity never passes.

``x < 0`` is false for NaN, so a bare comparison lets ``--model.max_grad_norm .nan`` through; every numeric argument
of a component goes through ``check_number`` instead, and the component raises the collected messages at once.
"""

from __future__ import annotations

import math


def check_number(
    errors: list[str],
    key: str,
    value: float | None,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    optional: bool = False,
) -> None:
    """Append a message to ``errors`` unless ``value`` is finite and within the bounds given.

    Args:
        errors: The component's list of problems.
        key: The config key, as a user writes it (``model.max_grad_norm``).
        value: The value to check; ``None`` passes when ``optional``.
        ge: Lower bound, inclusive.
        gt: Lower bound, exclusive.
        le: Upper bound, inclusive.
        lt: Upper bound, exclusive.
        optional: ``None`` (``null`` in YAML) is allowed.
    """
    if value is None and optional:
        return
    bounds = [f">= {ge:g}" if ge is not None else "", f"> {gt:g}" if gt is not None else ""]
    bounds += [f"<= {le:g}" if le is not None else "", f"< {lt:g}" if lt is not None else ""]
    wanted = " and ".join(b for b in bounds if b) or "a number"
    wanted += " or null" if optional else ""
    if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        errors.append(f"{key} must be {wanted}, got {value}")
    elif math.isinf(value):
        errors.append(f"{key} must be finite, got {value}")
    elif (
        (ge is not None and value < ge)
        or (gt is not None and value <= gt)
        or (le is not None and value > le)
        or (lt is not None and value >= lt)
    ):
        errors.append(f"{key} must be {wanted}, got {value:g}")


def raise_errors(errors: list[str]) -> None:
    """Raise one ``ValueError`` listing every problem, if there is any."""
    if errors:
        raise ValueError("; ".join(errors))
