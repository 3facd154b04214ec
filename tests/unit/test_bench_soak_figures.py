"""The soak's slope over the later half of its steady period tells a growth that levels off from one
that goes on: both rise over the whole period, only the leak still rises over its later half."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from sandbox_lanes_bench.soak_figures import later_half, report_rows, slope, summarise

HOURS = 2.0
NOISE_MIB = 1.0


def _samples(value: Callable[[float], float]) -> list[tuple[float, float]]:
    rng = random.Random(7)
    return [(t, value(t) + rng.gauss(0.0, NOISE_MIB)) for t in range(0, int(HOURS * 3600))]


def _leak(t: float) -> float:
    return 60.0 + 6.0 * t / 3600.0  # 6 MiB/h for as long as it runs


def _levels_off(t: float) -> float:
    return 60.0 + 9.0 * (1.0 - math.exp(-t / 900.0))  # a cache filling: 9 MiB, most in the first half hour


def test_a_leak_rises_as_fast_over_the_later_half() -> None:
    points = _samples(_leak)
    whole, later = slope(points), later_half(points)
    assert abs(whole["per_hour"] - 6.0) < 3 * whole["ci95_per_hour"]
    assert abs(later["per_hour"] - 6.0) < 3 * later["ci95_per_hour"]
    assert later["per_hour"] - later["ci95_per_hour"] > 5.0


def test_a_growth_that_levels_off_rises_over_the_whole_and_not_over_the_later_half() -> None:
    points = _samples(_levels_off)
    whole, later = slope(points), later_half(points)
    assert whole["per_hour"] > 2.0  # least squares over two hours of it: 2.5 MiB/h
    assert abs(later["per_hour"]) < 0.5  # 9 MiB * e^-4 is left to rise after the first hour: 0.16 MiB
    assert later["per_hour"] < whole["per_hour"] / 5


def test_the_table_shows_both_slopes() -> None:
    points = _samples(_levels_off)
    fig = {
        "minutes": HOURS * 60,
        "retention_s": 0,
        "lifetime_s": 0,
        "executions": 1,
        "lost": 0,
        "duplicates": 0,
        "bounces": [],
        "provision_ms": [[0.0, 1.0]],
        "teardown_ms": [[0.0, 1.0]],
        "bench_samples": {"columns": ["t_s", "lag"], "rows": [[0.0, 0]]},
        "pod_samples": {
            "columns": ["t_s", "rss_mib", "threads", "fds", "tasks", "states"],
            "rows": [[t, v, 20, 50, 30, 10] for t, v in points],
        },
    }
    rss = summarise(fig)["trends"]["rss_mib"]
    row = next(r for r in report_rows(fig) if r[0].startswith("soak: rss_mib"))
    assert row[1] == (
        f"{rss['per_hour']:+.3g} ± {rss['ci95_per_hour']:.2g}; "
        f"{rss['later_half_per_hour']:+.3g} ± {rss['later_half_ci95_per_hour']:.2g}"
    )
    assert rss["later_half_per_hour"] < rss["per_hour"] / 5
