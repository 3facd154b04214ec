"""The console script: every subcommand answers --help, and unknown input fails clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from consumers.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["run", "demo", "produce", "tail", "replay", "reap", "bench", "config", "config show"]


def sandbox_lanes(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "sandbox-lanes"
    return subprocess.run([str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_subcommand_is_registered() -> None:
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert choices is not None
    assert {c.split()[0] for c in SUBCOMMANDS} == set(choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str) -> None:
    done = sandbox_lanes(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sandbox-lanes " + command)


def test_top_level_help_lists_the_subcommands() -> None:
    done = sandbox_lanes("--help")
    assert done.returncode == 0
    for command in {c.split()[0] for c in SUBCOMMANDS}:
        assert command in done.stdout


def test_an_unknown_subcommand_fails_with_usage() -> None:
    done = sandbox_lanes("frobnicate")
    assert done.returncode == 2 and "invalid choice: 'frobnicate'" in done.stderr


def test_produce_refuses_a_file_with_an_unknown_event_type(tmp_path: Path) -> None:
    events = tmp_path / "events.yaml"
    events.write_text("- type: Nonsense\n  execution_id: x\n")
    done = sandbox_lanes("produce", str(events), "--bootstrap", "127.0.0.1:9")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"sandbox-lanes produce: {events}: event #0: unknown event type 'Nonsense' "
        "(known: ExecutionCreated, PhaseChanged, SessionDeleted)"
    )
    missing = sandbox_lanes("produce", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "No such file or directory" in missing.stderr
