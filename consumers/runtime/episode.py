"""A failure of the world, waited out: retried with backoff, logged once per episode.

An *episode* starts with the first failure of some work (a fetch, a take-over, a partition's
transaction) and ends once the work has gone :data:`SETTLE_S` without failing. Its first failure
is logged at ERROR with the error; the failures inside it are quiet (DEBUG), also when a success
comes between two of them (a broker that refuses one partition of a fetch fails every other
fetch); its end is logged once with how long it lasted and how many failures it counted. So a
broker that is down for ten minutes is two log lines, not a line per retry, and an operator still
sees when it began, why, and when it ended. The backoff before the next attempt grows with the
failures in a row and starts over after a success, so work that fails only now and then is not
held back for long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

#: The first retry waits this long; each next one twice as long, up to :data:`MAX_DELAY_S`.
FIRST_DELAY_S: Final = 0.1
MAX_DELAY_S: Final = 5.0
#: An episode ends once its work has gone this long without a failure.
SETTLE_S: Final = 10.0


class Episode:
    """One kind of work's failures, and the backoff before its next attempt."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        *,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        settle_s: float = SETTLE_S,
        extra: dict[str, object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self._logger = logger
        self._first = first_delay_s
        self._max = max_delay_s
        self._settle = settle_s
        self._extra = dict(extra or {})
        self._clock = clock
        #: Failures in the episode so far, and in a row (the backoff's exponent).
        self.attempts = 0
        self._in_a_row = 0
        self._since: float | None = None
        self._last_failure = 0.0

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException) -> float:
        """Count a failure; returns the seconds to wait before the next attempt."""
        name, text = type(exc).__name__, str(exc)
        error = text if text.startswith(name) else f"{name}: {text}" if text else name
        now = self._clock()
        self.attempts += 1
        self._in_a_row += 1
        self._last_failure = now
        if self._since is None:
            self._since = now
            self._logger.error(
                f"{self.what} failed; retrying with backoff until it succeeds",
                extra={**self._extra, "error": error},
            )
        else:
            self._logger.debug(
                f"{self.what} failed again", extra={**self._extra, "error": error, "attempts": self.attempts}
            )
        return float(min(self._max, self._first * 2 ** (self._in_a_row - 1)))

    def recovered(self) -> None:
        """The work succeeded: the backoff starts over; the episode ends (logged once) when it has
        gone :data:`SETTLE_S` without a failure."""
        self._in_a_row = 0
        if self._since is None or self._clock() - self._last_failure < self._settle:
            return
        self._logger.warning(
            f"{self.what} recovered",
            extra={
                **self._extra,
                "attempts": self.attempts,
                "seconds": round(self._last_failure - self._since, 3),
            },
        )
        self._since = None
        self.attempts = 0
