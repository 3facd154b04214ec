"""When to pause fetching: too many driver calls out. Hysteresis, so fetching does not flap."""

from __future__ import annotations

import logging

logger = logging.getLogger("sandbox_lanes.pod")


class FetchThrottle:
    """Throttled from ``high`` outstanding calls until fewer than ``low`` are (and never while stopping)."""

    def __init__(self, driver_concurrency: int, max_batch: int) -> None:
        self.high = max(4 * driver_concurrency, 4 * max_batch)
        self.low = max(driver_concurrency, max_batch)
        self.throttled = False

    def fetching(self, outstanding: int, stopping: bool) -> bool:
        """Update with the calls outstanding now; True = fetch."""
        if not self.throttled and outstanding >= self.high:
            self.throttled = True
            logger.warning(
                "driver calls backing up, pausing fetch",
                extra={"outstanding": outstanding, "resumeBelow": self.low},
            )
        elif self.throttled and outstanding < self.low and not stopping:
            self.throttled = False
            logger.info("driver calls caught up, fetching again", extra={"outstanding": outstanding})
        return not self.throttled and not stopping
