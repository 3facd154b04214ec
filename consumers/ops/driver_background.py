"""A driver's background work (upstream ``startBackground``): started once the pod is ready, stopped
(awaited) when the pod stops. Today the agent-sandbox idle sweep."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from consumers.runtime.session_activity import StoreSessionActivity

if TYPE_CHECKING:
    from consumers.ops.compose import Composed

logger = logging.getLogger("sandbox_lanes.driver")


class _Background(Protocol):
    async def stop(self) -> None: ...


def start_driver_background(composed: Composed) -> asyncio.Task[None] | None:
    """A pod background task that runs the driver's ``start_background`` while the pod runs."""
    start: Any = getattr(composed.provisioner, "start_background", None)
    if start is None:
        return None
    pod = composed.pod

    async def run() -> None:
        ready = asyncio.ensure_future(pod.ready.wait())
        stopping = asyncio.ensure_future(pod.stopping.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if pod.stopping.is_set():
            stopping.cancel()
            return
        work: _Background = start(StoreSessionActivity(pod))
        logger.info("driver background work started", extra={"driver": composed.lane.driver_name})
        try:
            await stopping
        finally:
            await work.stop()

    task = asyncio.create_task(run(), name="driver-background")
    pod.run_beside(task)
    return task
