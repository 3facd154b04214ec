"""Figure 5, beside the pod: Quix Streams restoring the same number of keys from its changelog.

The pod restores its in-memory store from the compacted state topic (:mod:`restore`). Quix restores
its RocksDB store from its changelog topic when a partition is assigned and the local store is
behind. So: the Quix peer first does the job over ``n`` fresh executions (its changelog then holds
``n`` keys, read back and counted), then is started again on an empty state directory, same group,
once per repeat. Its own log lines time the restore ("Beginning recovery check..." to "Recovery
process complete!", stamped as they arrive on an unbuffered pipe); the peak RSS is the process's
``VmHWM`` at the end of the restore. Sizes above :data:`QUIX_RESTORE_MAX` are not built through Quix
(the job alone would take minutes at its rate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import create_topic, delete_topics, prepared_inputs, summary
from sandbox_lanes_bench.peers_figure import (
    SINK_CONFIG,
    installed,
    peer_command,
    peer_internal_topics,
    run_peer,
)

QUIX_MODULE = "sandbox_lanes_bench.peers.quix_app"
QUIX_RESTORE_MAX = 100_000
BEGIN = "Beginning recovery check"
DONE = "Recovery process complete"
PARTITION_DONE = "Recovery successful for"


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


async def _changelog_keys(bootstrap: str, topic: str, partitions: int) -> tuple[int, float]:
    """Distinct keys committed to ``topic`` and the mean value size in bytes."""
    from aiokafka import TopicPartition

    from consumers.runtime.kafka.topic_reader import read_to_end

    keys: set[bytes] = set()
    size = records = 0
    # Quix's changelog has the source topic's partition count.
    async for _, recs in read_to_end(bootstrap, [TopicPartition(topic, p) for p in range(partitions)]):
        for rec in recs:
            keys.add(rec.key or b"")
            size += len(rec.value or b"")
            records += 1
    return len(keys), size / max(records, 1)


async def _restore_once(
    command: Callable[[str], list[str]], partitions: int, timeout_s: float
) -> dict[str, float]:
    """One Quix start on an empty state directory: restore seconds and peak RSS, from its own log."""
    with tempfile.TemporaryDirectory(prefix="sandbox-lanes-quix-restore-") as state_dir:
        argv = [*command(state_dir), "--log-level", "INFO"]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=state_dir,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert proc.stdout is not None
        began = 0.0
        rss_before = 0
        restored = 0
        tail: list[str] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    raw = await proc.stdout.readline()
                    if not raw:
                        raise RuntimeError(f"quix exited {await proc.wait()} before its restore: {tail}")
                    line = raw.decode(errors="replace")
                    tail = [*tail[-5:], line.strip()[:200]]
                    if BEGIN in line and not began:
                        began = time.monotonic()
                        rss_before = _status_kib(proc.pid, "VmRSS")
                    elif PARTITION_DONE in line:
                        restored += 1
                    elif DONE in line and began:
                        seconds = time.monotonic() - began
                        peak = _status_kib(proc.pid, "VmHWM")
                        break
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
    if restored != partitions:
        raise RuntimeError(f"quix restored {restored} of {partitions} partitions: {tail}")
    return {"seconds": seconds, "rss_peak_kib": peak, "rss_baseline_kib": rss_before}


async def measure_quix_restore(args: argparse.Namespace, bootstrap: str, show: bool) -> dict[str, Any]:
    if not installed("quix"):
        return {"not_installed": True, "sizes": {}}
    out: dict[str, Any] = {"not_installed": False, "max_size": QUIX_RESTORE_MAX, "sizes": {}}
    for n in [n for n in args.restore_sizes if n <= QUIX_RESTORE_MAX]:
        prepared = await prepared_inputs(bootstrap, "bench-quix-restore", args.partitions, n, show)
        tag, _, topics, created = prepared
        source, sink, group = topics.execution_created, f"{tag}.quix-sink", f"{tag}-quix"
        created.append(sink)
        try:
            await create_topic(bootstrap, sink, args.partitions, SINK_CONFIG)
            built = time.monotonic()
            await run_peer(QUIX_MODULE, bootstrap, source, sink, group, "exactly_once", args.partitions, n,
                           max(180.0, n / 100))  # fmt: skip
            build_s = time.monotonic() - built
            changelogs = [t for t in await peer_internal_topics(bootstrap, tag) if "changelog" in t]
            if len(changelogs) != 1:
                raise RuntimeError(f"expected one Quix changelog topic, found {changelogs}")
            keys, value_bytes = await _changelog_keys(bootstrap, changelogs[0], args.partitions)
            if keys != n:
                raise RuntimeError(f"Quix's changelog holds {keys} keys, not {n}")
            # Each restore gets its own empty state directory.
            command = functools.partial(peer_command, QUIX_MODULE, bootstrap, source, sink, group,
                                        "exactly_once", args.partitions)  # fmt: skip
            runs: list[dict[str, float]] = []
            with progress(f"quix restore {n:,}", args.repeats, enabled=show) as bar:
                for _ in range(args.repeats):
                    runs.append(await _restore_once(command, args.partitions, max(120.0, n / 500)))
                    bar.advance()
        finally:
            with contextlib.suppress(Exception):
                await delete_topics(bootstrap, created + await peer_internal_topics(bootstrap, tag))
        out["sizes"][str(n)] = {
            "executions": n,
            "changelog_keys": keys,
            "changelog_value_bytes": value_bytes,
            "build_seconds": build_s,
            "seconds": summary([r["seconds"] for r in runs]),
            "records_per_s": summary([n / r["seconds"] for r in runs]),
            "rss_peak_mib": summary([r["rss_peak_kib"] / 1024 for r in runs]),
            "rss_baseline_mib": summary([r["rss_baseline_kib"] / 1024 for r in runs]),
        }
    return out
