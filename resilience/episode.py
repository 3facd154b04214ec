"""A failure of the world, waited out: retried with :class:`Backoff`, logged once per episode.

An *episode* starts with the first failure of some work (a fetch, a take-over, a partition's
transaction, a watch) and ends once the work has gone ``settle_s`` without failing. Its first failure
is logged at ERROR with the error; the failures inside it are quiet (DEBUG), also when a success
comes between two of them (a broker that refuses one partition of a fetch fails every other fetch);
its end is logged once with how long it lasted and how many failures it counted. A long episode is
reminded of at WARNING every ``remind_s`` (still failing, how long, how many), never again at ERROR.
So a broker that is down for ten minutes is one ERROR line and its end, and an operator still sees
when it began, why, that it goes on, and when it ended.

An episode whose work stopped failing *without* a success to say so (the work was not tried again,
hours pass) is over too: the next failure after ``forget_s`` (5 minutes) of quiet starts a new
episode, logged at ERROR, rather than being counted, at DEBUG, into one that ended long ago. That
quiet is longer than ``settle_s`` because an attempt itself can outlast ``settle_s`` (a take-over
waiting out a 15 s broker deadline): a failure after it is the same outage, not a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from resilience.backoff import FIRST_DELAY_S, JITTER, MAX_DELAY_S, Backoff

#: An episode ends once its work has gone this long without a failure.
SETTLE_S: Final = 10.0
#: A long episode is recalled (WARNING, "still failing") this often.
REMIND_S: Final = 300.0
#: A failure after this long without one (and without a success) starts a new episode.
FORGET_S: Final = 300.0


def describe(exc: BaseException) -> str:
    """``Type: text`` of an error, once (some errors already start with their type's name)."""
    name, text = type(exc).__name__, str(exc)
    return text if text.startswith(name) else f"{name}: {text}" if text else name


class Episode:
    """One kind of work's failures, and the backoff before its next attempt."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        *,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        jitter: float = JITTER,
        settle_s: float = SETTLE_S,
        remind_s: float = REMIND_S,
        forget_s: float = FORGET_S,
        extra: dict[str, object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] | None = None,
    ) -> None:
        self.what = what
        self._logger = logger
        self.backoff = Backoff(first_s=first_delay_s, cap_s=max_delay_s, jitter=jitter)
        if rng is not None:
            self.backoff.rng = rng
        self._settle = settle_s
        self._remind = remind_s
        self._forget = max(forget_s, settle_s)
        self._extra = dict(extra or {})
        self._clock = clock
        #: Failures in the episode so far.
        self.attempts = 0
        self._since: float | None = None
        self._last_failure = 0.0
        self._last_reminder = 0.0
        self.last_error = ""

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    @property
    def in_a_row(self) -> int:
        return self.backoff.in_a_row

    def failed(self, exc: BaseException | str) -> float:
        """Count a failure; returns the seconds to wait before the next attempt."""
        error = exc if isinstance(exc, str) else describe(exc)
        now = self._clock()
        if self._since is not None and now - self._last_failure >= self._forget:
            self._end(now, "ended (no failure for a while)")  # quiet long enough: a new episode
            self.backoff.succeeded()
        self.attempts += 1
        self._last_failure = now
        self.last_error = error
        delay = self.backoff.failed()
        if self._since is None:
            self._since = self._last_reminder = now
            self._logger.error(
                f"{self.what} failed; retrying with backoff until it succeeds",
                extra={**self._extra, "error": error},
            )
        elif now - self._last_reminder >= self._remind:
            self._last_reminder = now
            self._logger.warning(
                f"{self.what} still failing; retrying with backoff",
                extra={
                    **self._extra,
                    "error": error,
                    "attempts": self.attempts,
                    "seconds": round(now - self._since, 3),
                    "delaySeconds": round(delay, 3),
                },
            )
        else:
            self._logger.debug(
                f"{self.what} failed again", extra={**self._extra, "error": error, "attempts": self.attempts}
            )
        return delay

    def recovered(self) -> None:
        """The work succeeded: the backoff starts over; the episode ends (logged once) when it has
        gone ``settle_s`` without a failure."""
        self.backoff.succeeded()
        if self._since is None or self._clock() - self._last_failure < self._settle:
            return
        self._end(self._clock(), "recovered")

    def _end(self, now: float, how: str) -> None:
        assert self._since is not None
        self._logger.warning(
            f"{self.what} {how}",
            extra={
                **self._extra,
                "attempts": self.attempts,
                "seconds": round(self._last_failure - self._since, 3),
            },
        )
        self._since = None
        self.attempts = 0
