"""The soak's allocation trace (``--soak-trace-allocations``) names the site that grew, and nothing
before the warm-up: what a census of tracked objects cannot show (strings kept in a dict of strings)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from sandbox_lanes_bench.soak import AllocationTrace
from sandbox_lanes_bench.soak_figures import census_growth, extra_lines

KEPT: dict[str, str] = {}


@pytest.fixture
def trace() -> Iterator[AllocationTrace]:
    allocations = AllocationTrace(frames=1, from_s=10.0)
    try:
        yield allocations
    finally:
        tracemalloc.stop()
        KEPT.clear()


def _keep(n: int) -> None:
    for i in range(n):
        KEPT[f"execution-{i:08d}"] = f"sandbox-name-{i:08d}-" + "x" * 40


def test_the_site_that_grew_after_the_warm_up_is_named_first(trace: AllocationTrace) -> None:
    _keep(2_000)  # during the warm-up: not counted
    assert trace.grown(5.0) == []
    assert trace.grown(10.0) == []  # the first snapshot after the warm-up: the base
    _keep(20_000)  # 18,000 more entries, each two strings
    grown = trace.grown(20.0)
    size, count, where = grown[0]
    assert "test_bench_soak_allocations.py" in where and size > 18_000 * 100 and count >= 18_000

    censuses = [[20.0, {"total": 1}, [], grown]]
    figures = {"allocations_grown": grown, "grown": {}, "from_s": 20.0, "to_s": 20.0}
    assert census_growth([[10.0, {"total": 1}, [], []], *censuses], 10.0)["allocations_grown"] == grown
    assert any("test_bench_soak_allocations.py" in line for line in extra_lines({"census_growth": figures}))
