"""docs/configuration.md, generated from ``SETTINGS``: the one place a setting is described is its row there.

``python -m consumers.ops.config_doc`` writes the file (run from the repository root, or give the path);
``--check`` exits 1 when the file differs from what ``SETTINGS`` renders (``tests/unit/test_config_doc.py``
does the same comparison in the test suite).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from consumers.ops.settings import SETTINGS, Setting

DEFAULT_PATH = Path("docs") / "configuration.md"

_HEAD = """\
# Configuration

<!-- Generated from SETTINGS in consumers/ops/settings.py by `python -m consumers.ops.config_doc`.
     Edit a setting's row there, then run that command; tests/unit/test_config_doc.py checks it. -->

Every knob comes from the environment (or a [config file](operations.md#config-file), which the
environment overrides). An empty value counts as unset. A wrong value fails at start-up with a message
naming the variable and the allowed values: see [one validation path](operations.md#one-validation-path)
for what `run` and `config check` refuse. `sandbox-lanes config show` prints the effective configuration
with secrets masked. The options of each driver (`SANDBOX_LANES_DRIVER_OPTIONS`) are in
[drivers.md](drivers.md).

| variable | default | meaning |
|---|---|---|
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row(setting: Setting) -> str:
    """One table row: the variable, its default as the pod applies it, and its meaning."""
    default = f"`{setting.default}`" if setting.default else setting.doc_default or "(empty)"
    return f"| `{setting.env}` | {_cell(default)} | {_cell(setting.help)} |"


def render(settings: Sequence[Setting] = SETTINGS) -> str:
    """The whole of docs/configuration.md."""
    return _HEAD + "".join(row(s) + "\n" for s in settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m consumers.ops.config_doc", description="write docs/configuration.md from SETTINGS"
    )
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH, help="default: %(default)s")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs, write nothing")
    args = parser.parse_args(argv)
    text = render()
    path: Path = args.path
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} differs from SETTINGS: run python -m consumers.ops.config_doc", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
