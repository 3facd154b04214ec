"""Figure ``scale``: (being written)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """This figure's options on ``sandbox-lanes bench``."""


def argv_of(args: argparse.Namespace) -> list[str]:
    """This figure's options as the run's recorded command line."""
    return []


async def measure_scale(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    raise NotImplementedError("scale")
