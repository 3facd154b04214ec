"""The benchmark in miniature, so it cannot rot: every figure present and positive (no timing thresholds)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from harness.dockerd import Dockerd
from sandbox_lanes_bench.plots import burst_rows

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.kafka, pytest.mark.docker]


def _plots(directory: Path, expected: set[str]) -> None:
    """The run's plots beside its JSON: exactly the charts its figures allow, each a non-empty SVG."""
    assert {p.name for p in directory.glob("*")} == {f"{name}.svg" for name in expected}, directory
    for name in expected:
        path = directory / f"{name}.svg"
        assert path.stat().st_size > 0, path
        root = ET.parse(path).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg", (path, root.tag)
        assert root.find(".//{http://www.w3.org/2000/svg}path") is not None, f"{path}: nothing drawn"


def _positive(fig: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = fig[key]
        if isinstance(value, dict):
            assert value["median"] > 0 and value["min"] > 0, (key, value)
            assert value["min"] <= value["median"] <= value["max"], (key, value)
        else:
            assert value > 0, (key, value)


#: The tiny default run measures each figure once: a second repeat cost ~60 s (every peer framework
#: started again, Quix's 5 s commit cadence each time); runs summarised over repeats are checked on
#: the cheap figures by test_bench_repeats_are_interleaved_runs_summarised_per_figure.
TINY_REPEATS = 1
PEER_EVENTS = 300


@pytest.mark.timeout(660)  # seven systems, each a process of its own for the peers
def test_bench_tiny_run_writes_every_figure(
    kafka_bootstrap: str, dockerd: Dockerd, docker_image: str, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress",
        "--repeats", str(TINY_REPEATS), "--events", "300", "--peer-events", str(PEER_EVENTS), "--partitions", "2",
        "--latency-seconds", "1", "--latency-warmup", "0.5",
        "--rules-events", "2000", "--restore-sizes", "200,1000",
        "--driver-samples", "2", "--docker-samples", "1",
        "--docker-host", dockerd.socket_url, "--docker-image", docker_image,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| figure | median | min-max | goal |" in proc.stdout
    doc = json.loads(out.read_text())

    meta = doc["meta"]
    assert meta["machine"]["cores"] > 0 and meta["machine"]["memory_gib"] > 0
    assert meta["versions"]["aiokafka"] not in ("", "?")
    assert meta["broker"]["bootstrap"] == kafka_bootstrap

    figs = doc["figures"]
    errors = {name: fig["error"] for name, fig in figs.items() if "error" in fig}
    assert not errors, errors

    tp = figs["throughput"]
    _positive(tp["ceiling"], "plain_pipe_events_per_s", "eos_pipe_2_writes_events_per_s")
    _positive(
        tp["pod"],
        "exactly_once_events_per_s",
        "at_least_once_events_per_s",
        "ratio_exactly_once",
        "ratio_at_least_once",
        "ratio_exactly_once_vs_eos_pipe",
    )
    assert len(tp["pod"]["exactly_once_events_per_s"]["runs"]) == TINY_REPEATS

    lat = figs["latency"]
    _positive(lat, "offered_rate", "samples", "p50_ms", "p95_ms", "p99_ms")
    assert lat["lost"] == 0
    assert lat["p50_ms"]["median"] <= lat["p95_ms"]["median"] <= lat["p99_ms"]["median"]

    # the peers on the same broker: every system ran, and every sink holds one outcome per event
    peers = figs["peers"]
    assert peers["not_installed"] == [] and peers["errors"] == {}, peers
    systems = {"pod", "quix", "faust", "confluent", "pod-rules-confluent"}
    assert {name.rsplit(".", 1)[0] for name in peers["events_per_s"]} == systems
    for name, rate in peers["events_per_s"].items():
        _positive(peers["events_per_s"], name)
        assert len(rate["runs"]) == TINY_REPEATS
        outcomes = PEER_EVENTS * TINY_REPEATS
        assert peers["checks"][name] == {"outcomes": outcomes, "duplicates": 0, "missing": 0}, name
    _positive(
        peers["ratios"], "pod.exactly_once / quix.exactly_once", "pod.exactly_once / confluent.exactly_once"
    )
    assert "8. peers (300 events): this pod, exactly_once" in proc.stdout

    _positive(figs["rules"], "decisions_per_s_per_core", "decide_only_per_s_per_core")

    restore = figs["restore"]
    assert set(restore["sizes"]) == {"200", "1000"}
    for size in restore["sizes"].values():
        _positive(size, "write_seconds", "seconds", "records_per_s", "rss_peak_mib", "rss_baseline_mib")
    _positive(restore, "state_value_bytes")
    # Quix Streams restoring the same number of keys: its changelog held every key, each run restored
    # every partition (the figure raises otherwise), and the rows stand under the pod's
    quix = figs["restore_quix"]
    assert quix["not_installed"] is False and set(quix["sizes"]) == {"200", "1000"}, quix
    for n, size in quix["sizes"].items():
        assert size["changelog_keys"] == int(n)
        _positive(size, "build_seconds", "changelog_value_bytes", "seconds", "records_per_s", "rss_peak_mib")
        assert len(size["seconds"]["runs"]) == TINY_REPEATS
    assert "Quix Streams restore 1k keys (RocksDB), seconds" in proc.stdout

    for name in ("local-process", "docker"):
        drv = figs["drivers"][name]
        assert "error" not in drv, drv
        _positive(drv, "samples", "ensure_p50_ms", "ensure_p99_ms", "re_ensure_p50_ms", "re_ensure_p99_ms")

    # the figures as pictures, beside the JSON: latency (figure 3) and the peers (figure 8); no burst or
    # retention figure in the default set, so no such chart
    _plots(tmp_path / "bench-plots", {"latency", "peers"})
    assert f"plots: {tmp_path / 'bench-plots' / 'latency.svg'}" in proc.stdout


@pytest.mark.timeout(300)  # the pipes and the pod, both guarantees, twice; the pure rules twice
def test_bench_repeats_are_interleaved_runs_summarised_per_figure(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """``--repeats 2`` on the cheap figures: each variant measured twice (its own sink and group each
    time, none reading the other's), every figure the median and min-max of its own two runs, and each
    ratio taken run by run (recomputed here from the runs, not from the bench's summary)."""
    out = tmp_path / "repeats.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "ceiling,pod,rules",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress", "--no-plots",
        "--repeats", "2", "--events", "300", "--partitions", "2", "--rules-events", "2000",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=270, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figs = json.loads(out.read_text())["figures"]
    errors = {name: fig["error"] for name, fig in figs.items() if "error" in fig}
    assert not errors, errors
    assert set(figs) == {"throughput", "rules"}, set(figs)

    tp = figs["throughput"]
    summaries = {
        **{f"ceiling.{k}": v for k, v in tp["ceiling"].items()},
        **{f"pod.{k}": v for k, v in tp["pod"].items()},
        **{f"rules.{k}": v for k, v in figs["rules"].items() if isinstance(v, dict)},
    }
    assert len(summaries) == 2 + 7 + 2, sorted(summaries)
    for name, fig in summaries.items():
        runs = fig["runs"]
        assert len(runs) == 2 and all(r > 0 for r in runs), (name, fig)
        assert (fig["min"], fig["median"], fig["max"]) == (min(runs), statistics.median(runs), max(runs)), (
            name
        )
    plain = tp["ceiling"]["plain_pipe_events_per_s"]["runs"]
    eos_pipe = tp["ceiling"]["eos_pipe_2_writes_events_per_s"]["runs"]
    pod = tp["pod"]
    for ratio, num, den in (
        ("ratio_exactly_once", pod["exactly_once_events_per_s"]["runs"], plain),
        ("ratio_at_least_once", pod["at_least_once_events_per_s"]["runs"], plain),
        ("ratio_exactly_once_vs_eos_pipe", pod["exactly_once_events_per_s"]["runs"], eos_pipe),
    ):
        assert pod[ratio]["runs"] == pytest.approx([a / b for a, b in zip(num, den, strict=True)]), ratio


@pytest.mark.kubernetes
@pytest.mark.timeout(600)  # five bursts, a private node and controller's start and stop
def test_bench_tiny_burst_measures_time_to_sandbox_for_every_driver(
    kafka_bootstrap: str, dockerd: Dockerd, docker_image: str, tmp_path: Path
) -> None:
    out = tmp_path / "burst.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "burst",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress", "--repeats", "1",
        "--burst-n", "40", "--burst-docker-n", "3", "--burst-latency-ms", "50", "--burst-k8s-n", "3",
        "--docker-host", dockerd.socket_url, "--docker-image", docker_image,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "7. burst of 40 creates" in proc.stdout, proc.stdout[-3000:]
    burst = json.loads(out.read_text())["figures"]["burst"]
    assert "error" not in burst.get("memory", {}) and "error" not in burst.get("docker", {}), burst
    for fig, n in ((burst["memory"], 40), (burst["docker"], 3)):
        assert fig["n"] == n
        _positive(fig, "provision_seconds", "ensures_per_s", "time_to_sandbox_p99_ms", "teardown_seconds")
        assert fig["max_transaction_s"] > 0
    _positive(burst["docker"], "raw_create_start_seconds", "ratio_to_raw")
    # kubernetes on the bench's own single-node cluster: create -> runner pod Running, next to docker
    k8s = burst["kubernetes"]
    assert "error" not in k8s and "error" not in k8s["docker_same_n"], k8s
    assert k8s["n"] == 3 and k8s["docker_same_n"]["n"] == 3 and k8s["cluster"] == "single-node cluster"
    _positive(k8s, "running_p50_ms", "running_p99_ms", "all_running_seconds", "time_to_sandbox_p99_ms")
    assert "kubernetes driver (single-node cluster): create -> runner pod Running" in proc.stdout
    # agent-sandbox on the same cluster: a Sandbox each, then claims on a warm pool of 3
    assert "agent_sandbox_error" not in k8s, k8s["agent_sandbox_error"]
    cold, warm = k8s["agent_sandbox_cold"], k8s["agent_sandbox_warm"]
    assert cold["n"] == warm["n"] == 3
    _positive(cold, "running_p50_ms", "running_p99_ms", "time_to_sandbox_p50_ms")
    _positive(
        warm, "time_to_sandbox_p50_ms", "time_to_sandbox_p99_ms", "pool_fill_seconds", "pool_refill_seconds"
    )
    _positive(warm, "sequential_p50_ms", "sequential_p99_ms")
    # async assignment (the default): every claim's runner got its secrets behind the outcome
    assert warm["assignment"] == "async"
    _positive(warm, "assigned_p50_ms", "sequential_assigned_p50_ms", "sequential_assigned_p99_ms")
    assert sum(warm["launches"].values()) == 6 and warm["adoption_misses"] == 0, warm  # burst + one by one
    assert "agent-sandbox warm, 3 creates one at a time on a full pool" in proc.stdout
    # every create timed step by step, each step seen (the pod's spans, the pool's timeline or the node's
    # pods and containerd's events, the runner's first line): the steps of one create add up to its total
    for label, steps, n in (
        ("kubernetes", k8s["steps"], 3),
        ("agent-sandbox cold", cold["steps"], 3),
        ("warm, one at a time", warm["sequential_steps"], 3),
        ("warm burst", warm["burst_steps"], 3),
    ):
        assert steps["creates"] == n and steps["whole"] == n, (label, steps)
        assert all(v >= 0 for v in steps["steps_p50_ms"].values()), (label, steps)
        runner = steps["samples_ms"]["runner_ready"]
        assert len(runner) == n and min(runner) > 0, (label, steps)
    assert k8s["steps"]["steps"][-4:] == [
        "sandbox_started",
        "container_created",
        "container_started",
        "runner_started",
    ]
    assert len(warm["sequential_steps"]["samples_ms"]["secrets_held"]) == 3
    # the runners took their secrets through the sessions opened ahead, or fresh execs: one each
    assert sum(warm["handovers"].values()) == 6, warm["handovers"]
    # the latency distributions per driver and launch type; the breakdown where rows carry their steps
    with_steps = [label for label, row in burst_rows(burst) if row.get("steps_p50_ms")]
    _plots(tmp_path / "burst-plots", {"burst-latency"} | ({"burst-breakdown"} if with_steps else set()))


@pytest.mark.timeout(300)  # two pods (a process each), two waves each, a restore after every wave
def test_bench_tiny_retention_keeps_state_flat_next_to_kept(kafka_bootstrap: str, tmp_path: Path) -> None:
    out = tmp_path / "retention.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "retention",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress", "--repeats", "1",
        "--partitions", "2", "--retention-waves", "2", "--retention-wave-size", "200",
        "--retention-seconds", "1",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=270, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())["figures"]["retention"]
    assert "error" not in fig, fig
    ret, kept = fig["runs"]["retention"], fig["runs"]["kept"]
    assert ret["retention_s"] == 1 and kept["retention_s"] == 0
    for run in (ret, kept):
        assert [w["wave"] for w in run["waves"]] == [1, 2]
        for wave in run["waves"]:
            _positive(wave, "stream_seconds", "rss_mib", "restore_seconds", "restore_records")
            assert wave["live_sandboxes"] == 0  # every sandbox torn down
    # with retention every finished state is tombstoned, in the pod and in what a restore keeps;
    # kept, both grow with every wave
    assert [w["keys_held"] for w in ret["waves"]] == [0, 0]
    assert [w["restore_keys"] for w in ret["waves"]] == [0, 0]
    assert [w["keys_held"] for w in kept["waves"]] == [200, 400]
    assert [w["restore_keys"] for w in kept["waves"]] == [200, 400]
    assert kept["ratios_to_first_wave"]["keys_held"] == [1.0, 2.0]
    assert "9. bounded state: 2 waves of 200 workflow executions" in proc.stdout
    assert "| keys held after the wait, kept | 200 (1.00x) | 400 (2.00x) |" in proc.stdout
    # keys and RSS over time: with retention never more than one wave's keys, kept all of them
    for run, most in ((ret, 200), (kept, 400)):
        assert run["samples"]["columns"] == ["t_s", "keys_held", "rss_mib"]
        rows = run["samples"]["rows"]
        assert len(rows) >= 4, rows
        assert [r[0] for r in rows] == sorted(r[0] for r in rows)
        assert max(r[1] for r in rows) == most, (run["retention_s"], rows)
        assert all(r[2] > 0 for r in rows)
    _plots(tmp_path / "retention-plots", {"retention"})


@pytest.mark.timeout(600)  # four systems' throughput, then each at half of it and one at a time; three slow
def test_bench_tiny_peers_latency_and_slow_driver(kafka_bootstrap: str, tmp_path: Path) -> None:
    out = tmp_path / "peers-latency.json"
    cmd = [
        sys.executable, "-m", "consumers.tools.cli", "bench", "--only", "peers_latency,slow_driver",
        "--bootstrap", kafka_bootstrap, "--out", str(out), "--no-progress", "--repeats", "1",
        "--partitions", "2", "--peer-events", "300", "--latency-seconds", "1", "--latency-warmup", "0.5",
        "--latency-floor-seconds", "1", "--latency-prime", "2",
        "--slow-events", "20", "--slow-latency-ms", "5,20", "--slow-timeout-s", "20",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=570, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figs = json.loads(out.read_text())["figures"]
    errors = {name: fig["error"] for name, fig in figs.items() if "error" in fig}
    assert not errors, errors

    # latency side by side: each system's throughput measured in the run, then halved; every outcome read
    lat = figs["peers_latency"]
    assert lat["not_installed"] == [] and lat["errors"] == {}, lat
    systems = {"pod", "quix", "faust", "confluent"}
    assert set(lat["throughput"]) == set(lat["half_rate"]) == set(lat["floor"]) == systems
    for system in systems:
        assert lat["throughput"][system] > 0
        assert lat["half_rate"][system]["offered_rate"] == lat["throughput"][system] / 2
        for fig in (lat["half_rate"][system], lat["floor"][system]):
            _positive(fig, "samples", "p50_ms", "p99_ms")
            assert fig["lost"] == 0, (system, fig)
    assert lat["goal"]["pod_p99_ms"] > 0 and lat["goal"]["quix_p50_ms"] > 0
    assert "10. produce -> outcome readable (read_committed), p50 / p99: this pod" in proc.stdout
    assert "pod p99 at half rate vs Quix p50 at half rate" in proc.stdout

    # the slow driver: every system finished its few events, the pod through its memory driver
    slow = figs["slow_driver"]
    assert slow["not_installed"] == [] and slow["errors"] == {}, slow
    assert set(slow["systems"]) == {"pod", "quix", "confluent"}
    for fig in slow["systems"].values():
        assert fig["finished"] and fig["readable"] == [20], fig
        _positive(fig, "events_per_s", "seconds", "time_to_outcome_p50_ms")
    _positive(slow, "ratio_pod_quix", "pod_driver_concurrency")
    assert "11. slow driver (20 events, 5-20 ms per ensure)" in proc.stdout
    _plots(tmp_path / "peers-latency-plots", {"peers"})  # figure 10's half of the peers chart
