"""The longest event-loop hold of the pod's periodic passes over a RocksDB store of 0 / 100k / 1M states
(issue 45 item 1): a reaper pass (plan, then each candidate's removal judged again in its turn) and a
retention check (``due()``), printed, never asserted.

No broker: the states are written straight into a real RocksDB store (``rocksdict``) through the
store's own ``apply``, across ``PARTITIONS`` partitions: a workflow's state as the pod stores it, half of
them finished with their retention past (a backlog of due keys), half live. The driver is the harness's
memory driver listing ``--listed`` workflow sandboxes (half of them terminal: candidates), a few
session sandboxes no state references and one of a deleted session (its partition is read through
for what references it: the pass's worst case, a third of the states); the outcomes go to a sink
in memory. A probe task on the same loop wakes on every turn of the loop (``sleep(0)``) and keeps
the longest gap between two of its wakes: the longest time something else held the loop. The
retention check is measured on the backlog, then again after 100k of its keys are tombstoned the
way the pod's retention does it (500 at a time). Last, the agent-sandbox idle sweep's question
of one session's activity (since issue 45 read from the store's session index; before, an index of
every session built over every held state).

``python -m sandbox_lanes_bench.loop_hold [--sizes 0,100000,1000000] [--listed 200]`` (under the heavy-run
lock). The code before issue 45 is measured by the same file with the older tree first on the path.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

PARTITIONS = 3
LISTED = 200
RETENTION_S = 86_400.0
DELETED = "ses-deleted"


class _Sink:
    """Stands in for the outcomes producer: the reaper's ``send_and_wait``."""

    def __init__(self) -> None:
        self.sent = 0

    async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
        self.sent += 1


class _Probe:
    """The longest gap between two wakes of a task that yields at every turn of the loop."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.wakes = 0
        self._stop = False

    async def run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            self.wakes += 1
            last = now

    async def measure(self, work: Callable[[], Awaitable[Any]]) -> tuple[float, float, Any]:
        """(seconds in all, longest hold in seconds, the work's result)."""
        self.longest, self.wakes, self._stop = 0.0, 0, False
        probe = asyncio.create_task(self.run())
        await asyncio.sleep(0)
        started = time.perf_counter()
        result = await work()
        took = time.perf_counter() - started
        self._stop = True
        await probe
        return took, self.longest, result


def _template() -> Any:
    from sandbox_lanes_bench.restore import _state_template

    return _state_template()


def _fill(store: Any, n: int, now: float) -> None:
    """n states: even ones finished (COMPLETED) with their retention past, odd ones live."""
    from events.sandbox_lanes.v1 import common_pb2, state_pb2

    template = _template()
    batch: dict[int, dict[str, state_pb2.ExecutionState]] = {p: {} for p in range(PARTITIONS)}
    for i in range(n):
        state = state_pb2.ExecutionState()
        state.CopyFrom(template)
        key = f"exec-{i:08d}"
        state.execution_id = key
        if i % 2 == 0:
            state.phase = common_pb2.EXECUTION_COMPLETED
            state.updated_at.FromSeconds(int(now - 2 * RETENTION_S))
        else:
            state.updated_at.FromSeconds(int(now))
        batch[i % PARTITIONS][key] = state
        if len(batch[i % PARTITIONS]) >= 5_000:
            store.apply(i % PARTITIONS, batch[i % PARTITIONS])
            batch[i % PARTITIONS] = {}
    for p, writes in batch.items():
        if writes:
            store.apply(p, writes)


async def _provisioner(n: int, listed: int) -> Any:
    """``listed`` workflow sandboxes: those of the first states (half finished: candidates), a few
    session sandboxes no state references, and the deleted session's."""
    from harness.memory_driver import MemoryProvisioner

    from drivers.contract import SandboxEnvironment

    provisioner = MemoryProvisioner()
    for i in range(min(listed, n)):
        await provisioner.ensure("workflow", f"exec-{i:08d}", SandboxEnvironment(task_queue="q"))
    for i in range(5):
        await provisioner.ensure("session", f"ses-{i}", SandboxEnvironment(task_queue="q"))
    await provisioner.ensure("session", DELETED, SandboxEnvironment(task_queue="q"))
    return provisioner


def _partition_of(key: str) -> int:
    """Where :func:`_fill` put a key (a session's sandbox and states: partition 0)."""
    return int(key[5:]) % PARTITIONS if key.startswith("exec-") else 0


def _local(store: Any) -> Any:
    """The pod's view of its states, as the reaper takes it (before issue 45: every state at once,
    for measuring the code before with the same bench)."""
    try:
        from consumers.ops.reaper_states import StoreStates
    except ImportError:

        def local() -> tuple[dict[str, Any], Callable[[str], bool]]:
            return dict(store.items()), lambda _key: True

        return local
    return StoreStates(store, _partition_of)


def _deleted_session(store: Any, now: float) -> None:
    """A deleted session whose sandbox is still listed: its verdict depends on what references
    it, so the pass reads its partition (a third of the states) through."""
    from events.sandbox_lanes.v1 import common_pb2, state_pb2

    state = state_pb2.ExecutionState(execution_id=DELETED, session_deleted=True)
    state.updated_at.FromSeconds(int(now))
    record = state.sandboxes.add()
    record.sandbox.scope = common_pb2.SANDBOX_SCOPE_SESSION
    record.sandbox.sandbox_id = DELETED
    record.lifecycle = state_pb2.SANDBOX_TEARDOWN_FAILED
    store.apply(_partition_of(DELETED), {DELETED: state})


async def _one_size(n: int, directory: Path, listed: int) -> dict[str, float]:
    from consumers.lanes.commands import LaneConfig
    from consumers.ops.reaper import Reaper, ReapResult
    from consumers.runtime.kafka.topology import Topics
    from consumers.runtime.state.rocksdb import RocksDBStore

    now = time.time()
    store = RocksDBStore("bench-state", RETENTION_S, directory=directory)
    store.adopt(range(PARTITIONS))
    started = time.perf_counter()
    _fill(store, n, now)
    _deleted_session(store, now)
    filled = time.perf_counter() - started
    probe = _Probe()
    provisioner = await _provisioner(n, listed)
    reaper = Reaper(
        provisioner,
        "127.0.0.1:9",
        Topics(),
        LaneConfig(enabled=True, driver_name="memory"),
        local=_local(store),
        states_expire=True,
    )
    sink = _Sink()

    async def reaper_pass() -> int:
        plans, _ = await reaper.plan()
        for plan in plans:
            if plan.verdict == "reap":
                await reaper._remove(ReapResult(plan), sink)
        return sink.sent

    pass_s, pass_hold, removed = await probe.measure(reaper_pass)

    async def retention_check() -> int:
        due = store.due(time.time(), 500)
        return sum(len(k) for k in due.values())

    due_s, due_hold, due_n = await probe.measure(retention_check)
    # The backlog's first 100k keys tombstoned as the pod's retention does (a batch of 500 due keys
    # at a time), then the check again: the due-time index now starts with deleted entries.
    dropped = 0
    while dropped < min(n // 2, 100_000):
        due = store.due(time.time(), 500)
        for p, keys in due.items():
            store.apply(p, dict.fromkeys(keys))
            dropped += len(keys)
        if not due:
            break
    _, after_hold, after_n = await probe.measure(retention_check)
    activity_hold = await _session_activity_hold(store, probe)
    store.close()
    row = {
        "states": float(n),
        "fill_s": filled,
        "pass_s": pass_s,
        "pass_hold_ms": pass_hold * 1000,
        "removed": float(removed),
        "due_s": due_s,
        "due_hold_ms": due_hold * 1000,
        "due_found": float(due_n),
        "due_after_drop_hold_ms": after_hold * 1000,
        "due_after_drop_found": float(after_n),
        "tombstoned": float(dropped),
        "session_activity_hold_ms": activity_hold * 1000,
    }
    print(
        f"{n:>9,} states: reaper pass {pass_s * 1000:9.1f} ms in all, longest loop hold "
        f"{pass_hold * 1000:8.2f} ms ({removed} removed); retention check hold {due_hold * 1000:6.2f} ms "
        f"({due_n} due); after {dropped:,} tombstoned {after_hold * 1000:6.2f} ms ({after_n} due)"
        f"; session activity (idle sweep) {activity_hold * 1000:8.2f} ms  [fill {filled:.0f} s]",
        flush=True,
    )
    return row


async def _session_activity_hold(store: Any, probe: _Probe) -> float:
    """The agent-sandbox idle sweep's question of one session's activity (``runtime.session_activity``):
    since issue 45 read from the store's session index (before: an index of every session built from
    all held states, at once, then a slice at a time beside the loop)."""
    from consumers.runtime.session_activity import StoreSessionActivity

    class _PodStandIn:
        states = store

        def input_partition_of(self, key: str) -> int:
            return 0

    reader = StoreSessionActivity(_PodStandIn())  # type: ignore[arg-type]

    async def ask() -> object:
        return reader.activity("ses-0")

    _, hold, _ = await probe.measure(ask)
    return hold


async def main(sizes: list[int], listed: int = LISTED) -> list[dict[str, float]]:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="loop-hold-") as tmp:
            rows.append(await _one_size(n, Path(tmp), listed))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,100000,1000000")
    parser.add_argument("--listed", type=int, default=LISTED, help="workflow sandboxes listed")
    args = parser.parse_args()
    asyncio.run(main([int(s) for s in args.sizes.split(",")], args.listed))
