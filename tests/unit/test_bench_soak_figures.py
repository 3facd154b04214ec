"""The soak's slope over the later half of its steady period tells a growth that levels off from one
that goes on: both rise over the whole period, only the leak still rises over its later half."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from sandbox_lanes_bench.soak_figures import between_bounces, later_half, report_rows, slope, summarise, t95

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
        f"{rss['later_half_per_hour']:+.3g} ± {rss['later_half_ci95_per_hour']:.2g}; -"  # no bounces
    )
    assert rss["later_half_per_hour"] < rss["per_hour"] / 5


# --- a mean per cycle between bounces: an interval that holds when samples are not independent ------

BOUNCE_EVERY_S = 240.0
BOUNCE_DOWN_S = 20.0


def _bounced(seed: int, per_hour: float) -> tuple[list[tuple[float, float]], list[dict[str, float]]]:
    """A count like the soak's threads or descriptors: a level that stays where a bounce left it until
    the next (a connection more or fewer, a pool's worker), -3 while a broker is down, +6 for the
    closed producer lingering after it comes back; and ``per_hour`` of steady growth under it."""
    rng = random.Random(seed)
    bounces = [
        {"down_t_s": d, "up_t_s": d + BOUNCE_DOWN_S}
        for d in (BOUNCE_EVERY_S * k for k in range(1, int(HOURS * 3600 / BOUNCE_EVERY_S)))
    ]
    points, level, k = [], 0.0, 0
    for t in range(int(HOURS * 3600)):
        while k < len(bounces) and t >= bounces[k]["up_t_s"]:
            level, k = float(rng.choice((-2, -1, 0, 1, 2))), k + 1
        down = k < len(bounces) and bounces[k]["down_t_s"] <= t
        lingering = k > 0 and t < bounces[k - 1]["up_t_s"] + 40
        value = 27 + level + per_hour * t / 3600.0 - 3 * down + 6 * lingering + rng.gauss(0.0, 0.3)
        points.append((float(t), value))
    return points, bounces


def test_a_flat_count_that_steps_with_bounces_is_called_flat_per_cycle_not_per_second() -> None:
    """Over 60 runs of a count with no growth at all: a slope through its samples a second apart calls
    most of them rising or falling (its interval assumes independent samples); through a mean per cycle,
    about one run in twenty, as a 95 % interval should."""
    per_second = per_cycle = 0
    runs = 60
    for seed in range(runs):
        points, bounces = _bounced(seed, 0.0)
        fit = slope(points)
        per_second += abs(fit["per_hour"]) > fit["ci95_per_hour"]
        cycles = between_bounces(points, bounces)
        assert len(cycles) == len(bounces) + 1  # the stretch before the first bounce and after each
        c = slope(cycles)
        per_cycle += abs(c["per_hour"]) > c["ci95_per_hour"] / 1.96 * t95(c["n"] - 2)
    assert per_second > runs / 2, per_second
    assert per_cycle <= runs * 0.15, per_cycle


def test_a_count_that_grows_under_the_steps_is_seen_per_cycle() -> None:
    points, bounces = _bounced(3, 2.0)  # two a hour
    c = slope(between_bounces(points, bounces))
    half = c["ci95_per_hour"] / 1.96 * t95(c["n"] - 2)
    assert c["per_hour"] - half > 0.5 and abs(c["per_hour"] - 2.0) < half


def test_t95_against_the_table() -> None:
    for df, table in ((4, 2.776), (5, 2.571), (10, 2.228), (25, 2.060), (100, 1.984)):
        assert abs(t95(df) - table) < 0.01, (df, t95(df))


def test_summarise_gives_the_slope_per_cycle_and_the_table_shows_it() -> None:
    """Through ``summarise``, as a run's figures are made: the warm-up cut, the stretches between the
    run's bounces, the later half's, and the table's text of both."""
    points, bounces = _bounced(5, 2.0)
    fig = {
        "minutes": HOURS * 60,
        "retention_s": 60,
        "lifetime_s": 4,
        "executions": 1,
        "lost": 0,
        "duplicates": 0,
        "bounces": bounces,
        "provision_ms": [[0.0, 1.0]],
        "teardown_ms": [[0.0, 1.0]],
        "bench_samples": {"columns": ["t_s", "lag"], "rows": [[0.0, 0]]},
        "pod_samples": {
            "columns": ["t_s", "rss_mib", "threads", "fds", "tasks", "states"],
            "rows": [[t, 60.0, v, 50, 30, 10] for t, v in points],
        },
    }
    threads = summarise(fig)["trends"]["threads"]
    stretches = len(bounces) + 1  # the first from the warm-up's end (124 s) to the first bounce
    assert threads["cycles_n"] == stretches, threads
    assert threads["cycles_later_half_n"] in (stretches // 2, stretches // 2 + 1), threads
    assert abs(threads["cycles_per_hour"] - 2.0) < threads["cycles_ci95_per_hour"], threads
    row = next(r for r in report_rows(fig) if r[0].startswith("soak: threads "))
    assert row[1].endswith(
        f"{threads['cycles_per_hour']:+.3g} ± {threads['cycles_ci95_per_hour']:.2g} ({stretches}); "
        f"{threads['cycles_later_half_per_hour']:+.3g} ± {threads['cycles_later_half_ci95_per_hour']:.2g} "
        f"({threads['cycles_later_half_n']})"
    ), row


def test_t95_at_few_degrees_of_freedom() -> None:
    assert t95(1) == 12.706 and t95(2) == 4.303 and t95(0) == float("inf")


def test_a_stretch_cut_short_is_left_out_and_each_sits_at_its_samples_time() -> None:
    points, bounces = _bounced(1, 0.0)
    late = [p for p in points if p[0] >= 220.0]  # 20 samples before the first bounce (at 240 s)
    cycles = between_bounces(late, bounces)
    assert len(cycles) == len(bounces)  # the first stretch, 20 samples, is not one
    # the second: from 60 s after the first broker came back (260 + 60) to the second bounce (480)
    assert cycles[0][0] == sum(range(320, 480)) / 160


def test_the_soak_lag_is_unknown_while_a_known_commit_is_answered_missing() -> None:
    """A coordinator loading after a bounce answers -1 for partitions that have committed offsets: the
    sample is unknown, not the whole partition in lag (the 200k-record spikes of the two-hour runs)."""
    from sandbox_lanes_bench.soak import CommittedLag

    lag = CommittedLag()
    assert lag.lag({}, {"a": 10, "b": 5}) == 15  # before the group's first commit: from 0
    assert lag.lag({"a": 8, "b": 5}, {"a": 10, "b": 5}) == 2
    assert lag.lag({"a": -1, "b": 5}, {"a": 90_000, "b": 5}) is None  # a's commit not answered
    assert lag.lag({"b": 5}, {"a": 90_000, "b": 5}) is None  # nor given at all
    assert lag.lag({"a": 89_990, "b": 5}, {"a": 90_000, "b": 6}) == 11
