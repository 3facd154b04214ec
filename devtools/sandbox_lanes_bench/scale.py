"""Figure ``scale``: (being written)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This figure's options on ``sandbox-lanes bench``."""


def argv_of(args: argparse.Namespace) -> list[str]:
    """This figure's options as the run's recorded command line."""
    return []


async def measure_scale(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    raise NotImplementedError("scale")


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """This figure's rows of the run's table: (figure, median, min-max, goal)."""
    return []


def extra_lines(fig: dict[str, Any]) -> list[str]:
    """Markdown printed under the run's table (a table of its own), or nothing."""
    return []


def draw(fig: dict[str, Any], doc: Any) -> Figure | None:
    """This figure's chart (``<name>.svg``), or None when the figure has nothing to draw."""
    return None
