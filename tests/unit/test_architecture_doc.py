"""ARCHITECTURE.md's diagram names every module of each layer, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("tools", "ops", "runtime", "lanes")


def _diagram_rows() -> dict[str, set[str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("```", 2)[1]
    names: dict[str, set[str]] = {}
    layer = ""
    for line in block.splitlines():
        if "│" not in line:
            continue
        cell = line.split("│")[1]
        first = cell.split()[0] if cell.split() else ""
        if first in LAYERS:
            layer = first
            cell = cell.replace(first, "", 1)
        cell = re.sub(r"\([^)]*\)", "", cell)  # "reaper (CLI)": the note is not a module
        names.setdefault(layer, set()).update(n.strip().rstrip("/") for n in cell.split("·") if n.strip())
    return names


def _modules(layer: str) -> set[str]:
    folder = ROOT / "consumers" / layer
    found = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    found |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return found


def test_the_diagram_lists_each_layers_modules_as_they_are() -> None:
    rows = _diagram_rows()
    for layer in LAYERS:
        assert rows.get(layer) == _modules(layer), (layer, rows.get(layer, set()) ^ _modules(layer))
