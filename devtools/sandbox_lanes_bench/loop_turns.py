"""The event loop's turns, timed: how long each turn of the running loop was busy (its callbacks, not
its wait in ``select``), for the scale figure's loop p50/p99/max and a pass's longest hold.

A probe task that wakes at every turn (``sleep(0)``, as :mod:`sandbox_lanes_bench.loop_hold` does) keeps
the loop from ever waiting, so it burns a core beside the pod and skews the CPU per event measured in
the same window. This probe instead wraps the loop's own turn (``BaseEventLoop._run_once``) and its
selector's ``select``: a turn's busy time is the turn's time less its wait for I/O. Beside it, the
loop thread's CPU time in the turn: on a shared machine a turn is also long when the process was
descheduled in it, which its CPU time does not count (the two apart say how much of a hold was the
machine's). A few clock reads per turn; nothing else runs. CPython's pure-Python loop only (not
uvloop, which the pod does not use).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from typing import Any


class LoopTurns:
    """Busy seconds of each turn of ``loop`` while installed (``with LoopTurns(loop) as turns:``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if not hasattr(loop, "_run_once") or not hasattr(loop, "_selector"):
            raise TypeError(f"{type(loop).__name__}: not CPython's selector loop; its turns cannot be timed")
        self.loop: Any = loop
        self.busy = array("d")
        self.cpu = array("d")
        self._waited = 0.0
        self._installed = False

    def __enter__(self) -> LoopTurns:
        loop = self.loop
        selector = loop._selector
        run_once: Callable[[], None] = loop._run_once
        select: Callable[..., Any] = selector.select
        clock = time.perf_counter
        cpu = time.thread_time

        def timed_select(timeout: float | None = None) -> Any:
            started = clock()
            try:
                return select(timeout)
            finally:
                self._waited += clock() - started

        def timed_turn() -> None:
            self._waited = 0.0
            started, used = clock(), cpu()
            try:
                run_once()
            finally:
                self.busy.append(clock() - started - self._waited)
                self.cpu.append(cpu() - used)

        selector.select = timed_select
        loop._run_once = timed_turn
        self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            del self.loop._run_once  # the class's own again
            del self.loop._selector.select
            self._installed = False

    def mark(self) -> int:
        """Where the turns recorded so far end: :meth:`since` a mark gives a window's turns."""
        return len(self.busy)

    def since(self, mark: int) -> list[float]:
        """Busy seconds of each turn since ``mark``."""
        return list(self.busy[mark:])

    def cpu_since(self, mark: int) -> list[float]:
        """The loop thread's CPU seconds in each turn since ``mark``."""
        return list(self.cpu[mark:])


class GcPauses:
    """The garbage collector's pauses while installed (``gc.callbacks``): a long turn that is one of
    these is the collector's, not the work that happened to allocate when it ran."""

    def __init__(self) -> None:
        self.pauses = array("d")
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._started)

    def __enter__(self) -> GcPauses:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def mark(self) -> int:
        return len(self.pauses)

    def longest_since(self, mark: int) -> float:
        """The longest pause since ``mark``, seconds (0 for none)."""
        return max(self.pauses[mark:], default=0.0)


def turn_figures(busy: list[float]) -> dict[str, float]:
    """A window's turns: count, p50, p99 and max in milliseconds (nearest rank)."""
    from sandbox_lanes_bench.common import pct

    ms = [b * 1000 for b in busy]
    return {
        "turns": float(len(ms)),
        "p50_ms": pct(ms, 50),
        "p99_ms": pct(ms, 99),
        "max_ms": max(ms) if ms else 0.0,
    }
