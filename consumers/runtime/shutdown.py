"""Bounded shutdown: the work in flight and the background tasks get what is left of the bound."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable
from typing import Any


async def run_until_bound(
    work: Coroutine[Any, Any, None],
    stop: asyncio.Event,
    seconds_left: Callable[[], float],
    on_bound: Callable[[], None],
) -> None:
    """Run ``work``; once ``stop`` is set it gets ``seconds_left()``, then it is cancelled.

    ``on_bound`` is called when the bound cancels it. ``work`` raising propagates.
    """
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait({task}, timeout=max(0.0, seconds_left()))
        if not task.done():
            on_bound()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        task.result()
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def end_tasks(tasks: Iterable[asyncio.Task[None]], seconds_left: float, cancel_wait_s: float) -> None:
    """Wait for ``tasks`` up to ``seconds_left``; cancel the late ones and give them ``cancel_wait_s``."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, late = await asyncio.wait(pending, timeout=max(0.0, seconds_left))
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=cancel_wait_s)


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait ``seconds``, or less if ``stop`` is set meanwhile; whether it is set. Every loop of the
    pod waits between its attempts or ticks this way, so none outlives a stop."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
