"""The soak in miniature (issue 45 item 3): 45 s of it on its own three-node cluster, one broker bounced,
so the sampler, the figures and the chart cannot rot. What is checked comes from the run's parameters and
from the broker (every execution's outcomes read back), not from the figure's own arithmetic; no timing is
asserted."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.kafka]


@pytest.mark.timeout(420)
def test_a_short_soak_samples_every_second_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    minutes, rate = 0.75, 5.0
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "soak", "--out", str(out),
        "--no-progress", "--minutes", f"{minutes:g}", "--soak-rate", f"{rate:g}", "--soak-lifetime-s", "2",
        "--soak-retention-s", "20", "--soak-bounce-every-s", "15", "--soak-bounce-down-s", "3",
        "--soak-dir", str(tmp_path / "rows"),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())["figures"]["soak"]
    assert "error" not in fig, fig

    # the stream: rate x duration executions, each provisioned once and torn down once (read back from
    # the outcomes topic), though a broker went down and came back during it
    assert abs(fig["executions"] - rate * minutes * 60) <= rate * 2, fig["executions"]
    assert fig["provisioned"] == fig["deprovisioned"] == fig["executions"]
    # no duplicate outcome but a create the bench sent again (its ack lost in the bounce) once its
    # execution's state could be removed: that one is a new execution by design (guarantees: Retention)
    assert (fig["lost"], fig["duplicates_unexplained"], fig["unexpected_outcomes"]) == (0, 0, 0), fig
    assert fig["bounces"] and all(b["up_t_s"] > b["down_t_s"] for b in fig["bounces"]), fig["bounces"]
    assert len(fig["provision_ms"]) == len(fig["teardown_ms"]) == fig["executions"]

    # the pod's own rows: one a second, every column read
    columns, rows = fig["pod_samples"]["columns"], fig["pod_samples"]["rows"]
    assert len(rows) >= 0.8 * minutes * 60, len(rows)
    assert all(len(r) == len(columns) for r in rows)
    assert all(b[0] > a[0] for a, b in itertools.pairwise(rows)), "rows out of time order"
    col = {name: [r[columns.index(name)] for r in rows] for name in columns}
    assert (
        min(col["rss_mib"]) > 10 and min(col["threads"]) > 1 and min(col["fds"]) > 3 and min(col["tasks"]) > 1
    )
    # what RocksDB holds in memory, read from the store's databases: some, and less than the RSS
    assert max(col["rocksdb_mib"]) > 0 and all(
        r < m for r, m in zip(col["rocksdb_mib"], col["rss_mib"], strict=True)
    )
    # the heap beside it: Python's blocks in use, glibc's heap in use; the census of tracked objects by
    # type, first taken 30 s in
    assert min(col["py_blocks"]) > 1000 and min(col["malloc_used_mib"]) > 0
    # ... the main thread's arena apart from the others' (librdkafka's and RocksDB's threads have theirs)
    assert min(col["main_arena_used_mib"]) > 0 and max(col["thread_arenas_used_mib"]) > 0
    # the threads by who made them, the descriptors by kind: they add up to the counts beside them; the
    # pod holds broker connections and RocksDB's files (2 s apart: a thread may start between reads)
    parts = zip(col["threads_python"], col["threads_librdkafka"], col["threads_rocksdb"], strict=True)
    assert all(abs(sum(p) - n) <= 2 for p, n in zip(parts, col["threads"], strict=True))
    assert min(col["threads_python"]) >= 1 and max(col["threads_librdkafka"]) > 0
    assert max(col["threads_rocksdb"]) > 0
    fds = zip(col["fds_sockets"], col["fds_store"], col["fds_other"], strict=True)
    assert all(abs(sum(p) - n) <= 3 for p, n in zip(fds, col["fds"], strict=True))
    assert max(col["fds_sockets"]) > 3 and min(col["fds_store"]) > 0
    assert fig["censuses"] and all(c[1]["total"] > 1000 and c[2][0][1] > 100 for c in fig["censuses"])
    # retention (20 s) removed states during the run: more were made than were ever held at once
    assert 0 < max(col["states"]) < fig["executions"], max(col["states"])
    assert col["provisioned"][-1] >= fig["executions"] * 0.9
    # the bench's rows: the group's lag was read while the cluster answered
    lag = [r[-1] for r in fig["bench_samples"]["rows"]]
    assert any(v is not None for v in lag)

    # the figures and the chart
    for name in ("rss_mib", "threads", "fds", "tasks", "states", "rss_beyond_rocksdb_mib"):
        assert fig["trends"][name]["n"] > 10, (name, fig["trends"][name])
    assert "soak 0.75 min: executions lost / duplicate outcomes" in proc.stdout
    svg = tmp_path / "soak-plots" / "soak.svg"
    root = ET.parse(svg).getroot()
    text = " ".join(root.itertext())
    assert "RSS, MiB" in text and "consumer lag, records" in text, text[:500]
