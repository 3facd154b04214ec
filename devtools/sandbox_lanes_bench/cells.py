"""A figure's cells in the bench's markdown table: what ``table`` and every figure's ``report_rows`` use
(a module of its own, so that the table imports the figures and no figure imports the table)."""

from __future__ import annotations

from typing import Any


def fmt(value: float, unit: str = "") -> str:
    if value >= 100:
        text = f"{value:,.0f}"
    elif value >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text}{unit}"


def cells(s: dict[str, Any], unit: str = "") -> tuple[str, str]:
    return fmt(s["median"], unit), f"{fmt(s['min'], unit)}-{fmt(s['max'], unit)}"


def goal(met: bool, text: str) -> str:
    return f"{text} {'met' if met else 'MISSED'}"
