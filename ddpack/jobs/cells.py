"""How a value reads in a cell of the tables the host prints and draws (compare's, report's page, the goodput model's),
written once so that the same number reads the same in each."""

from __future__ import annotations

from typing import Any


def cell(value: Any, empty: str = "-") -> str:
    """A float to four significant digits, None as `empty` (a text table's "-", an HTML table's blank), else as str()."""
    if value is None:
        return empty
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def duration(seconds: float | None) -> str:
    """Seconds under two minutes, else minutes to a tenth; None as "-"."""
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
