"""The one backoff (resilience.backoff) and the episode log built on it, broker-free."""

from __future__ import annotations

import logging

import pytest

from resilience.backoff import Backoff, backoff_delay
from resilience.episode import Episode


def test_the_delay_doubles_from_the_first_and_stops_at_the_cap() -> None:
    delays = [backoff_delay(n, first_s=0.1, cap_s=5.0) for n in range(0, 10)]
    assert delays == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0])


def test_a_million_failures_in_a_row_neither_overflow_nor_exceed_the_cap() -> None:
    backoff = Backoff(first_s=0.1, cap_s=5.0, jitter=0.0)
    delays = {backoff.failed() for _ in range(1_000_000)}
    assert max(delays) == 5.0
    assert backoff.in_a_row == 1_000_000
    assert backoff.at_cap
    # The same far past where 2 ** n overflows a float (n = 1,025).
    assert backoff_delay(10**9, first_s=0.1, cap_s=30.0) == 30.0


def test_jitter_takes_at_most_its_fraction_off_and_never_adds() -> None:
    low = Backoff(first_s=1.0, cap_s=1.0, jitter=0.25, rng=lambda: 0.999999)
    high = Backoff(first_s=1.0, cap_s=1.0, jitter=0.25, rng=lambda: 0.0)
    assert 0.75 <= low.failed() < 0.7501
    assert high.failed() == 1.0


def test_a_success_starts_the_backoff_over() -> None:
    backoff = Backoff(first_s=0.1, cap_s=5.0, jitter=0.0)
    for _ in range(20):
        backoff.failed()
    backoff.succeeded()
    assert backoff.failed() == pytest.approx(0.1)


@pytest.mark.parametrize("first,cap", [(0.0, 1.0), (1.0, 0.0)])
def test_a_backoff_needs_positive_delays(first: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(first_s=first, cap_s=cap)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _levels(caplog: pytest.LogCaptureFixture, logger: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger]


def test_an_episode_logs_one_error_then_reminds_at_warning_and_ends_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    episode = Episode(
        "the work", logging.getLogger("t.ep1"), clock=clock, rng=lambda: 0.0, remind_s=300.0, settle_s=10.0
    )
    with caplog.at_level(logging.DEBUG, logger="t.ep1"):
        for _ in range(2_000):  # a 10-minute outage at the cap: 2,000 failures 0.3 s apart
            episode.failed(ConnectionError("down"))
            clock.now += 0.3
        clock.now += 11
        episode.recovered()
    records = _levels(caplog, "t.ep1")
    errors = [m for level, m in records if level == logging.ERROR]
    warnings = [m for level, m in records if level == logging.WARNING]
    assert errors == ["the work failed; retrying with backoff until it succeeds"]
    assert warnings == ["the work still failing; retrying with backoff", "the work recovered"]
    assert not episode.ongoing


def test_a_failure_after_a_long_quiet_starts_a_new_episode_at_error(caplog: pytest.LogCaptureFixture) -> None:
    """An episode whose work was not tried again (no success to end it) is over after the quiet:
    the next failure, hours later, is an ERROR again, not a DEBUG line of the old episode."""
    clock = _Clock()
    episode = Episode("the work", logging.getLogger("t.ep2"), clock=clock, rng=lambda: 0.0)
    with caplog.at_level(logging.DEBUG, logger="t.ep2"):
        episode.failed(ConnectionError("first"))
        clock.now += 3 * 3600
        delay = episode.failed(ConnectionError("second"))
    errors = [m for level, m in _levels(caplog, "t.ep2") if level == logging.ERROR]
    assert len(errors) == 2
    assert delay == pytest.approx(0.1)  # the backoff started over with the new episode


def test_attempts_longer_than_the_settle_time_stay_one_episode(caplog: pytest.LogCaptureFixture) -> None:
    """A take-over that fails after waiting out a 15 s broker deadline, again and again, is one
    outage: one ERROR, and its backoff grows to the cap instead of starting over each time."""
    clock = _Clock()
    episode = Episode("taking over", logging.getLogger("t.ep3"), clock=clock, rng=lambda: 0.0, settle_s=10.0)
    with caplog.at_level(logging.DEBUG, logger="t.ep3"):
        delays = []
        for _ in range(12):
            delays.append(episode.failed(TimeoutError("15 s deadline")))
            clock.now += 15 + delays[-1]
    errors = [m for level, m in _levels(caplog, "t.ep3") if level == logging.ERROR]
    assert len(errors) == 1
    assert delays[-1] == 5.0
