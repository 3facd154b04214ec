"""``sandbox-lanes bench --only scale`` in miniature (0 and 2,000 states held, 300 creates), through the
CLI on the real broker: every figure of every size present and positive, the states held and the work
done as the run was set up, the ratios to the empty store, and the chart drawn. No timing threshold:
the figures' values are the bench's to print (docs/performance.md, "At scale: the states held")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIZES = (0, 2000)
EVENTS = 300
CANDIDATES = 4
LISTED = 50
PASSES = 2
ROUNDS = 2

pytestmark = [pytest.mark.kafka]

#: Positive at every size (seconds, rates, turn times, memory).
POSITIVE = (
    "write_seconds",
    "restore_from_empty_s",
    "stream_seconds",
    "events_per_s",
    "cpu_us_per_event",
    "loop_cpu_us_per_event",
    "loop_turn_p50_ms",
    "loop_turn_p99_ms",
    "loop_turn_max_ms",
    "loop_turn_cpu_p99_ms",
    "pod_turn_p50_ms",
    "pod_turn_p99_ms",
    "reaper_pass_s",
    "reaper_longest_hold_ms",
    "reaper_longest_hold_cpu_ms",
    "read_through_pass_s",
    "read_through_longest_hold_ms",
    "restart_to_ready_s",
    "restart_longest_hold_ms",
    "rss_ready_mib",
    "rss_after_stream_mib",
    "disk_mib",
)


@pytest.mark.timeout(240)  # two sizes, three pod processes each: 16.6-20.3 s here (the broker 5-6 s more)
def test_bench_tiny_scale_measures_every_figure_at_every_size(kafka_bootstrap: str, tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "scale",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress", "--partitions", "2",
        "--scale-sizes", ",".join(map(str, SIZES)), "--scale-events", str(EVENTS),
        "--scale-listed", str(LISTED), "--scale-candidates", str(CANDIDATES), "--scale-passes", str(PASSES),
        "--scale-rounds", str(ROUNDS),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    fig = doc["figures"]["scale"]
    assert "error" not in fig, fig
    assert "--scale-sizes 0,2000 --scale-events 300" in doc["meta"]["command"]
    assert "--scale-rounds 2" in doc["meta"]["command"]
    assert list(fig["sizes"]) == [str(n) for n in SIZES] and fig["base"] == 0
    for n in SIZES:
        row = fig["sizes"][str(n)]
        for key in POSITIVE:
            assert row[key] > 0, (n, key, row[key])
        # What the run set up: the held states and the reaper's (finished workflows, a deleted
        # session) restored; after the stream, its executions too; every create provisioned once.
        assert row["states_held"] == n + CANDIDATES + 1, row
        assert row["states_held_after"] == n + CANDIDATES + 1 + ROUNDS * EVENTS, row
        assert row["ensures_per_round"] == [EVENTS] * ROUNDS
        assert all(len(values) == ROUNDS for values in row["rounds"].values())
        assert row["loop_turn_p50_ms"] <= row["loop_turn_p99_ms"] <= row["loop_turn_max_ms"]
        assert row["loop_cpu_us_per_event"] <= row["cpu_us_per_event"]  # the loop's thread, of the process's
        assert row["gc_longest_ms"] >= row["reaper_gc_longest_ms"] >= 0
        assert (
            len(row["restart_to_ready_runs_s"]) == 2 * ROUNDS
            and max(row["restart_to_ready_runs_s"]) == row["restart_to_ready_max_s"]
        )
        passes = row["reaper_passes"]
        assert [p["read_through"] for p in passes] == ([0.0] * PASSES + [1.0]) * ROUNDS
        for p in passes:
            listed = LISTED + 5 + CANDIDATES + p["read_through"]  # the held, quiet sessions, candidates
            assert p["listed"] == listed, p
            # every finished execution's sandbox reaped, and the deleted session's in the last pass
            assert p["removed"] == p["candidates"] == CANDIDATES + p["read_through"], p
    # Ratios to the empty store, each the size's figure over the first size's.
    base = fig["sizes"]["0"]
    for key, ratio in fig["ratios"]["2000"].items():
        assert ratio == pytest.approx(fig["sizes"]["2000"][key] / base[key]), key
    assert fig["ratios"]["0"]["events_per_s"] == 1.0
    rates = [fig["sizes"][str(n)]["rounds"]["events_per_s"] for n in SIZES]
    assert fig["ratios_by_round"]["2000"]["events_per_s"] == pytest.approx(
        [a / b for a, b in zip(rates[1], rates[0], strict=True)]
    )
    goals = fig["goals"]
    assert goals["at"] == 2000
    assert goals["throughput_ratio"] == fig["ratios"]["2000"]["events_per_s"]
    assert "12. scale: events/s with 2k states held / with 0" in proc.stdout
    assert "| events/s |" in proc.stdout and "| 0 states | 2k states |" in proc.stdout
    svg = tmp_path / "scale-plots" / "scale.svg"
    assert svg.stat().st_size > 0
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.find(".//{http://www.w3.org/2000/svg}path") is not None, "nothing drawn"
    assert "12. the pod with the states held" in svg.read_text()
