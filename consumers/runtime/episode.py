"""A failure of the world, waited out: retried with backoff, logged once per episode.

An *episode* starts with the first failure of some work (a fetch, a take-over) and ends with
its first success. Its first failure is logged at ERROR with the error; the retries inside it
are quiet (DEBUG); its end is logged once with how long it lasted and how many attempts it
took. So a broker that is down for ten minutes is two log lines, not a line per retry, and an
operator still sees when it began, why, and when it ended.
"""

from __future__ import annotations

import logging
import time
from typing import Final

#: The first retry waits this long; each next one twice as long, up to :data:`MAX_DELAY_S`.
FIRST_DELAY_S: Final = 0.1
MAX_DELAY_S: Final = 5.0


class Episode:
    """One kind of work's failures in a row, and the backoff before its next attempt."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        *,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        extra: dict[str, object] | None = None,
    ) -> None:
        self.what = what
        self._logger = logger
        self._first = first_delay_s
        self._max = max_delay_s
        self._extra = dict(extra or {})
        self.attempts = 0
        self._since: float | None = None

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException) -> float:
        """Count a failure; returns the seconds to wait before the next attempt."""
        name, text = type(exc).__name__, str(exc)
        error = text if text.startswith(name) else f"{name}: {text}" if text else name
        self.attempts += 1
        if self._since is None:
            self._since = time.monotonic()
            self._logger.error(
                f"{self.what} failed; retrying with backoff until it succeeds",
                extra={**self._extra, "error": error},
            )
        else:
            self._logger.debug(
                f"{self.what} failed again", extra={**self._extra, "error": error, "attempts": self.attempts}
            )
        return float(min(self._max, self._first * 2 ** (self.attempts - 1)))

    def recovered(self) -> None:
        """The work succeeded: end the episode (logged once when there was one)."""
        if self._since is None:
            return
        self._logger.warning(
            f"{self.what} recovered",
            extra={
                **self._extra,
                "attempts": self.attempts,
                "seconds": round(time.monotonic() - self._since, 3),
            },
        )
        self._since = None
        self.attempts = 0
