"""consumers/ops/progress.py: a bar with counts and rate on a terminal, nothing when not a terminal."""

from __future__ import annotations

import os
import re
import select
import sys
import time

import pytest

from consumers.ops.progress import progress


def _read_all(fd: int, idle: float = 0.5, limit: float = 10.0) -> str:
    """Everything written to the pty so far.

    The kernel hands slave writes to the master asynchronously (the tty flip buffer), so one
    short read is not the end of the output: read until nothing more arrives for `idle` seconds.
    """
    chunks = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], idle)
        if not ready:
            break
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_the_bar_shows_the_description_the_counts_and_the_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", closefd=False)
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("COLUMNS", "100")
    try:
        with progress("replaying", total=10) as bar:  # enabled: stderr is a terminal
            for _ in range(4):
                bar.advance()
                time.sleep(0.05)
            bar.advance(2)
        tty.flush()
        text = _read_all(master)
    finally:
        monkeypatch.undo()
        tty.close()
        os.close(master)
        os.close(slave)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert "replaying" in plain
    assert "6/10" in plain
    assert re.search(r"\d[\d,]*/s", plain), plain  # the rate column


def test_not_a_terminal_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert not sys.stderr.isatty()
    with progress("benchmarking", total=3) as bar:
        bar.advance(3)
        bar.total(5)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_forced_off_on_a_terminal_and_an_unknown_total(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with progress("chaos", enabled=False) as bar:
        bar.advance(100)
    assert capsys.readouterr().err == ""
    # Forced on (e.g. --progress) with no total at first: a total can be set later.
    monkeypatch.setenv("COLUMNS", "100")
    with progress("chaos", enabled=True) as bar:
        bar.advance(7)
        bar.total(7)
    err = capsys.readouterr().err
    assert "chaos" in err and "7/7" in err
