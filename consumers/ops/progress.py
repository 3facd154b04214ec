"""Progress output for long CLI work (replay, bench, chaos): a rich bar with counts and rate.

Off when stderr is not a terminal (CI logs, pipes): then nothing is drawn and
callers print their own summary lines.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol


class Tracker(Protocol):
    def advance(self, n: int = 1) -> None: ...

    def total(self, total: int | None) -> None: ...


class _Silent:
    def advance(self, n: int = 1) -> None:
        return None

    def total(self, total: int | None) -> None:
        return None


class _RichTracker:
    def __init__(self, progress: object, task: object) -> None:
        self._progress = progress
        self._task = task

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)  # type: ignore[attr-defined]

    def total(self, total: int | None) -> None:
        self._progress.update(self._task, total=total)  # type: ignore[attr-defined]


@contextmanager
def progress(description: str, total: int | None = None, *, enabled: bool | None = None) -> Iterator[Tracker]:
    on = sys.stderr.isatty() if enabled is None else enabled
    if not on:
        yield _Silent()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class _Rate(TextColumn):
        def __init__(self) -> None:
            super().__init__("")

        def render(self, task):  # type: ignore[no-untyped-def]
            from rich.text import Text

            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f}/s" if speed else "-/s")

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _Rate(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield _RichTracker(bar, task)
