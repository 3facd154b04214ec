"""One bounded backoff: capped, jittered, and no overflow however long the failures last.

The delay before retry *n* (1-based, failures in a row) is ``first * factor ** (n - 1)`` capped at
``cap``, less up to ``jitter`` of itself at random ("equal jitter": the delay never falls below
``(1 - jitter)`` of the deterministic value, so a cap still bounds the rate of attempts, and pods
that failed together do not retry together). The exponent stops growing once the cap is reached, so
a million failures in a row cost what the first few do: no ``OverflowError`` and no float ``inf``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

#: Defaults of a broker-facing retry loop: 100 ms, doubling, at most 5 s apart.
FIRST_DELAY_S: Final = 0.1
MAX_DELAY_S: Final = 5.0
FACTOR: Final = 2.0
JITTER: Final = 0.2


def backoff_delay(failures_in_a_row: int, *, first_s: float, cap_s: float, factor: float = FACTOR) -> float:
    """The deterministic (un-jittered) delay after ``failures_in_a_row`` failures (``<= 0``: none)."""
    if failures_in_a_row <= 0:
        return 0.0
    if first_s >= cap_s or factor <= 1.0:
        return min(first_s, cap_s) if factor <= 1.0 else cap_s
    # The exponent at which the cap is reached; past it the cap is the answer (no power computed).
    steps_to_cap = math.ceil(math.log(cap_s / first_s, factor))
    exponent = failures_in_a_row - 1
    if exponent >= steps_to_cap:
        return cap_s
    return min(cap_s, first_s * factor**exponent)


@dataclass
class Backoff:
    """Failures in a row, and the delay before the next attempt.

    ``failed()`` counts a failure and returns the seconds to wait; ``succeeded()`` starts over.
    ``rng`` is injectable so a test can pin the jitter (``lambda: 0.0`` for none).
    """

    first_s: float = FIRST_DELAY_S
    cap_s: float = MAX_DELAY_S
    factor: float = FACTOR
    jitter: float = JITTER
    rng: Callable[[], float] = field(default=random.random, repr=False)
    in_a_row: int = 0

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.cap_s <= 0:
            raise ValueError("a backoff's first delay and cap must be positive")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("a backoff's jitter is a fraction in [0, 1)")

    def failed(self) -> float:
        """Count one failure; the seconds to wait before the next attempt."""
        # Saturate the counter too: an int never overflows in Python, but the count is reported.
        self.in_a_row += 1
        return self.peek()

    def peek(self) -> float:
        """The delay the current count calls for (jittered), without counting a failure."""
        delay = backoff_delay(self.in_a_row, first_s=self.first_s, cap_s=self.cap_s, factor=self.factor)
        return delay * (1.0 - self.jitter * self.rng())

    @property
    def at_cap(self) -> bool:
        """The delay has stopped growing (a long outage: the episode's reminders say so)."""
        delay = backoff_delay(self.in_a_row, first_s=self.first_s, cap_s=self.cap_s, factor=self.factor)
        return delay >= self.cap_s

    def succeeded(self) -> None:
        self.in_a_row = 0
