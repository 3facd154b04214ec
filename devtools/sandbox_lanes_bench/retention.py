"""Figure 9 (``--only retention``): bounded state. The same stream through a pod twice, with and without
retention.

Each run is a real pod (exactly_once, memory driver) in a child process of its own, so its RSS is the
pod's alone and neither run inherits the other's heap. It is fed ``--retention-waves`` waves of
``--retention-wave-size`` fresh CLOUD workflow executions: each wave's creates, then (once every one
is provisioned) their COMPLETED phase changes, then a wait past the retention. After each wave:

* keys held in the pod's store at the wave's end (every teardown committed) and after the wait;
* the pod process's RSS (``VmRSS``, after ``gc.collect()``) and the bytes its store holds (keys and
  serialized values). Not ``tracemalloc``: it slowed the pod 4-5x here;
* the state topic restored by a fresh memory store in another child process (``--repeats`` times,
  read_committed, as a pod taking the partitions over): seconds, records read, keys kept and the
  restoring process's peak RSS (``VmHWM``); and once by the RocksDB store kept in one directory across
  the waves (``disk_restore_*``: from the previous wave's checkpoint, so only that wave's records).
  A restore that meets a tombstone drops the key, so keys
  restored drop whether or not compaction ran; records read drop only once it has.

The wait after a wave with retention lasts until the pod holds no key: the pod tombstones at most
``max_batch`` (500) due keys a second, so it also shows how long a wave takes to clear.

Over the whole run the pod's child also samples keys held and RSS (``VmRSS``, no ``gc.collect()``) every
``SAMPLE_EVERY_S``: each run's ``samples`` rows ``[t_s, keys_held, rss_mib]``, seconds from the first
wave's start, and each wave's ``t_s`` at its report (the keys and RSS over time of the plot).

One run with ``SANDBOX_LANES_STATE_RETENTION_S`` = ``--retention-seconds`` (2), one with 0 (kept for
ever), same broker, same stream. With retention, keys, memory and restore stay flat (≈ what is in
flight); kept, they grow with every wave. Figures are per wave and as ratios to the first wave.

The state topic's time constants are the pod's scaled from hours to seconds (both runs alike), so
compaction can run within the figure: segments roll after 1 s (10 min in production), records are
compactable at once (1 h) and tombstones are dropped 1 s after a cleaning pass (24 h). The memory
driver's call log (it keeps every call for the tests) is cleared as the run goes, so it does not
count as the pod's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import statistics
import tempfile
import time
import uuid
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import (
    child_process,
    create_topic,
    create_topics,
    created_event,
    delete_topics,
    lane_env,
    read_status,
    recv,
)

logger = logging.getLogger("sandbox_lanes.bench")

MIB = 1024 * 1024
#: Production -> bench: the state topic's time constants in seconds instead of hours.
BENCH_STATE_OVERRIDES = {
    "segment.ms": "1000",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "1000",
    "min.cleanable.dirty.ratio": "0.01",
}
#: How often the pod's child samples its keys held and RSS (the time series of the plot).
SAMPLE_EVERY_S = 0.25
#: What each wave reports, and what the ratios to the first wave are taken of.
RATIO_KEYS = (
    "keys_at_wave_end",
    "keys_held",
    "rss_mib",
    "store_mib",
    "restore_seconds",
    "restore_records",
    "restore_keys",
    "restore_rss_peak_mib",
)


def state_topic_config() -> dict[str, str]:
    from consumers.runtime.kafka.topology import STATE_TOPIC_CONFIG

    return {**STATE_TOPIC_CONFIG, **BENCH_STATE_OVERRIDES}


# --- the pod's child process --------------------------------------------------------------------


def _count(pod: Any, kind: str) -> int:
    return sum(n for name, n in pod.stats.outputs.items() if name.endswith("." + kind))


async def _until(pod: Any, provisioner: Any, kind: str, target: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _count(pod, kind) < target:
        provisioner.calls.clear()
        failed = _count(pod, "SandboxFailed") + _count(pod, "SandboxTeardownFailed")
        if failed or pod.stats.dead_lettered:
            raise RuntimeError(f"{failed} driver failures, {pod.stats.dead_lettered} dead letters")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_count(pod, kind)}/{target} {kind} in {timeout_s:.0f}s")
        await asyncio.sleep(0.05)


async def _send(producer: Any, topic: str, messages: list[Any]) -> None:
    from events.codec import encode

    futures: list[asyncio.Future[Any]] = []
    for message in messages:
        rec = encode(message, source="bench")
        futures.append(await producer.send(topic, rec.value, key=rec.key, headers=rec.headers))
    await asyncio.gather(*futures)


def _terminal(execution_id: str, event_id: str) -> Any:
    from events.codec import new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

    return inputs_pb2.PhaseChanged(
        meta=new_meta(event_id=event_id, source="bench"),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )


async def _pod_run(spec: dict[str, Any], conn: Any) -> None:
    from aiokafka import AIOKafkaProducer

    from consumers.ops.settings import load_settings
    from sandbox_lanes_bench.common import memory_provisioner, running_pod

    env: dict[str, str] = spec["env"]
    n: int = spec["wave_size"]
    retention_s: int = spec["retention_s"]
    topics = load_settings(env).topics
    loop = asyncio.get_running_loop()
    provisioner = memory_provisioner()
    wave_timeout = max(120.0, n / 50)
    async with running_pod(env, provisioner=provisioner) as pod:
        producer = AIOKafkaProducer(
            bootstrap_servers=env["KAFKA_BOOTSTRAP_SERVERS"], acks="all", linger_ms=20,
            max_batch_size=512 * 1024,
        )  # fmt: skip
        await producer.start()
        samples: list[tuple[float, int, float]] = []

        async def sample() -> None:
            """(seconds since the first wave, keys held, RSS MiB) every SAMPLE_EVERY_S, the whole run."""
            while True:
                samples.append((time.perf_counter() - began, len(pod.states), read_status("VmRSS") / MIB))
                await asyncio.sleep(SAMPLE_EVERY_S)

        sampler: asyncio.Task[None] | None = None
        try:
            gc.collect()
            conn.send({"ready_rss_mib": read_status("VmRSS") / MIB})
            began = time.perf_counter()
            sampler = asyncio.create_task(sample())
            for wave in range(spec["waves"]):
                ids = [f"{spec['tag']}-w{wave}-{i:06d}" for i in range(n)]
                started = time.perf_counter()
                await _send(producer, topics.execution_created, [created_event(e, f"{e}-c") for e in ids])
                await _until(pod, provisioner, "SandboxProvisioned", (wave + 1) * n, wave_timeout)
                await _send(producer, topics.phase_changed, [_terminal(e, f"{e}-t") for e in ids])
                await _until(pod, provisioner, "SandboxDeprovisioned", (wave + 1) * n, wave_timeout)
                stream_s = time.perf_counter() - started
                at_end = len(pod.states)
                # Past the retention (the same nominal wait in the run that keeps everything), then
                # until the pod has tombstoned every finished state (it removes max_batch a second).
                waited = time.perf_counter()
                await asyncio.sleep(spec["settle_s"])
                deadline = time.monotonic() + spec["settle_s"] + n / 100 + 30
                while retention_s > 0 and len(pod.states) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                wait_s = time.perf_counter() - waited
                provisioner.calls.clear()
                gc.collect()
                store_bytes = sum(len(key) + state.ByteSize() for key, state in pod.states.items())
                conn.send(
                    {
                        "wave": wave + 1,
                        "executions_so_far": (wave + 1) * n,
                        "stream_seconds": stream_s,
                        "keys_at_wave_end": at_end,
                        "wait_seconds": wait_s,
                        "keys_held": len(pod.states),
                        "rss_mib": read_status("VmRSS") / MIB,
                        "store_mib": store_bytes / MIB,
                        "live_sandboxes": len(provisioner.live),
                        "max_transaction_s": pod.stats.max_transaction_s,
                        "t_s": time.perf_counter() - began,
                        # the samples since the last report; the parent joins them into the run's series
                        "samples": samples[:],
                    }
                )
                samples.clear()
                go = await loop.run_in_executor(None, conn.recv)  # the parent's restore is done
                if go != "next":
                    return
        finally:
            if sampler is not None:
                sampler.cancel()
            await producer.stop()


# --- a store's restore, in a child process -------------------------------------------


def _restore_child(
    bootstrap: str,
    topic: str,
    partitions: int,
    retention_s: int,
    repeats: int,
    conn: Any,
    directory: str = "",
) -> None:
    """``directory``: the RocksDB store kept there across waves (each wave's restore resumes from the
    previous one's checkpoint); otherwise a fresh memory store."""
    try:
        from consumers.runtime.state.store import open_store

        runs: list[dict[str, Any]] = []
        for _ in range(repeats):
            store = open_store("rocksdb" if directory else "memory", topic, retention_s, directory or None)
            report = asyncio.run(
                store.restore(bootstrap, range(partitions), isolation_level="read_committed")
            )
            runs.append({"seconds": report.seconds, "records": report.records, "keys": len(store)})
            store.close()
            del store
            gc.collect()
        conn.send({"runs": runs, "rss_peak_mib": read_status("VmHWM") / MIB})
    except BaseException as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


async def _restore(
    bootstrap: str, topic: str, partitions: int, retention_s: int, repeats: int, directory: str = ""
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_restore_child, args=(bootstrap, topic, partitions, retention_s, repeats, child, directory)
    )
    proc.start()
    child.close()
    try:
        result = await loop.run_in_executor(None, recv, parent, 600.0)
    finally:
        await loop.run_in_executor(None, proc.join, 60)
        if proc.is_alive():
            proc.kill()
    if "error" in result:
        raise RuntimeError(f"restore of {topic} failed: {result['error']}")
    runs = result["runs"]
    return {
        "restore_seconds": statistics.median(r["seconds"] for r in runs),
        "restore_seconds_runs": [r["seconds"] for r in runs],
        "restore_records": runs[-1]["records"],
        "restore_keys": runs[-1]["keys"],
        "restore_records_runs": [r["records"] for r in runs],
        "restore_rss_peak_mib": result["rss_peak_mib"],
    }


# --- one run and the figure ---------------------------------------------------------------------


async def _run(args: argparse.Namespace, bootstrap: str, retention_s: int, show: bool) -> dict[str, Any]:
    from consumers.ops.settings import load_settings

    tag = f"bench-ret{retention_s}-{uuid.uuid4().hex[:6]}"
    env = {
        **lane_env(bootstrap, tag, args.partitions, "exactly_once"),
        "SANDBOX_LANES_STATE_RETENTION_S": str(retention_s),
    }
    topics = load_settings(env).topics
    waves, n = args.retention_waves, args.retention_wave_size
    spec = {
        "env": env,
        "tag": tag,
        "waves": waves,
        "wave_size": n,
        "retention_s": retention_s,
        "settle_s": args.retention_seconds + 1.5,
    }
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    label = f"retention {retention_s} s" if retention_s else "kept for ever"
    reports: list[dict[str, Any]] = []
    series: list[list[float]] = []
    disk_tmp = tempfile.TemporaryDirectory(prefix="bench-retention-state-")
    disk_dir = disk_tmp.name
    try:
        # The pod never creates its inputs; the state topic gets the bench's scaled time constants.
        await create_topic(bootstrap, topics.state, args.partitions, state_topic_config())
        await create_topics(bootstrap, topics, args.partitions)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=child_process, args=(_pod_run, spec, child))
        proc.start()
        child.close()
        try:
            first = await loop.run_in_executor(None, recv, parent, 180.0)
            if "error" in first:
                raise RuntimeError(f"{label}: the pod did not start: {first['error']}")
            with progress(f"{label}: {waves} waves of {n:,}", waves, enabled=show) as bar:
                for _ in range(waves):
                    report = await loop.run_in_executor(None, recv, parent, max(300.0, n / 20))
                    if "error" in report:
                        raise RuntimeError(f"{label}: {report['error']}")
                    rows = report.pop("samples")
                    series.extend([round(t, 3), keys, round(rss, 2)] for t, keys, rss in rows)
                    report.update(
                        await _restore(bootstrap, topics.state, args.partitions, retention_s, args.repeats)
                    )
                    # The RocksDB store restored once per wave into the same directory: from the
                    # previous wave's checkpoint, so it reads only this wave's records.
                    disk = await _restore(bootstrap, topics.state, args.partitions, retention_s, 1, disk_dir)
                    report.update(
                        {
                            "disk_restore_seconds": disk["restore_seconds"],
                            "disk_restore_records": disk["restore_records"],
                            "disk_restore_keys": disk["restore_keys"],
                        }
                    )
                    reports.append(report)
                    parent.send("next")
                    bar.advance()
        finally:
            with contextlib.suppress(Exception):
                parent.send("stop")
            await loop.run_in_executor(None, proc.join, 90)
            if proc.is_alive():
                proc.kill()
            parent.close()
    finally:
        disk_tmp.cleanup()
        await delete_topics(bootstrap, list(topics.all()))
    return {
        "retention_s": retention_s,
        "ready_rss_mib": first["ready_rss_mib"],
        "waves": reports,
        # over time, while the pod runs (the parent's restores after each wave included): one row per
        # sample, what the plot of keys and RSS over time is drawn from (sandbox_lanes_bench.plots)
        "samples": {"columns": ["t_s", "keys_held", "rss_mib"], "every_s": SAMPLE_EVERY_S, "rows": series},
        "ratios_to_first_wave": {key: _ratios([r[key] for r in reports]) for key in RATIO_KEYS},
    }


def _ratios(values: list[float]) -> list[float | None]:
    first = values[0] if values else 0
    return [v / first if first else None for v in values]


async def measure_retention(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    """Both runs on one broker: retention ``--retention-seconds``, then 0 (kept)."""
    if args.retention_seconds <= 0:
        raise ValueError("--retention-seconds must be > 0 (the other run is the one without)")
    runs: dict[str, Any] = {}
    for retention_s in (args.retention_seconds, 0):
        runs["retention" if retention_s else "kept"] = await _run(args, bootstrap, retention_s, show)
    return {
        "waves": args.retention_waves,
        "wave_size": args.retention_wave_size,
        "partitions": args.partitions,
        "retention_s": args.retention_seconds,
        "state_topic_overrides": dict(BENCH_STATE_OVERRIDES),
        "runs": runs,
    }


# --- the table ----------------------------------------------------------------------------------


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The main table's rows: the last wave against the first, with retention and kept."""
    rows: list[tuple[str, str, str, str]] = []
    ret, kept = fig["runs"]["retention"], fig["runs"]["kept"]
    last = len(ret["waves"]) - 1
    total = fig["waves"] * fig["wave_size"]
    head = f"9. after {total:,} executions ({fig['waves']} waves), retention {fig['retention_s']} s / kept"
    for key, label in (
        ("keys_held", "keys held"),
        ("rss_mib", "pod RSS, MiB"),
        ("restore_seconds", "restore, seconds"),
        ("restore_keys", "keys restored"),
    ):
        a, b = ret["waves"][last][key], kept["waves"][last][key]
        ra, rb = ret["ratios_to_first_wave"][key][last], kept["ratios_to_first_wave"][key][last]
        rows.append(
            (
                f"{head}: {label}" if not rows else f"   {label}",
                f"{_num(a)} / {_num(b)}",
                f"last / first wave: {_ratio(ra)} / {_ratio(rb)}",
                "",
            )
        )
    return rows


def wave_table(fig: dict[str, Any]) -> list[str]:
    """Per wave, both runs side by side: value (ratio to the first wave)."""
    ret, kept = fig["runs"]["retention"], fig["runs"]["kept"]
    waves = len(ret["waves"])
    r = fig["retention_s"]
    lines = [
        f"9. bounded state: {fig['waves']} waves of {fig['wave_size']:,} workflow executions (create → "
        f"COMPLETED), retention {r} s next to kept for ever; value (x wave 1)",
        "",
        "| per wave | " + " | ".join(f"wave {w + 1}" for w in range(waves)) + " |",
        "|---|" + "---|" * waves,
    ]
    for key, label in (
        ("keys_at_wave_end", "keys at the wave's end"),
        ("keys_held", "keys held after the wait"),
        ("wait_seconds", "wait after the wave, s"),
        ("rss_mib", "pod RSS, MiB"),
        ("store_mib", "store, MiB (keys + values)"),
        ("restore_seconds", "restore, seconds"),
        ("restore_records", "restore, records read"),
        ("restore_keys", "restore, keys kept"),
        ("restore_rss_peak_mib", "restore, peak RSS, MiB"),
    ):
        for name, run in ((f"retention {r} s", ret), ("kept", kept)):
            values = [w[key] for w in run["waves"]]
            ratios = run["ratios_to_first_wave"].get(key) or _ratios(values)
            row = [f"{_num(v)} ({_ratio(q)})" for v, q in zip(values, ratios, strict=True)]
            lines.append(f"| {label}, {name} | " + " | ".join(row) + " |")
    return lines


def _num(value: float) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
