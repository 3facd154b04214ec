"""The scale figure's pod, in a child process of its own (its RSS and CPU are its own): a real pod on the
RocksDB store, over a state topic already holding the states of the size measured.

In order, two processes, each reporting to the parent on its pipe:

1. **restore** (a process of its own, so its restore's heap is not counted after): the pod started on
   an empty directory restores the held states from the topic (a restore from empty; it leaves a
   checkpoint) and is stopped (a clean stop: a last checkpoint);
2. the parent produces the input stream (no pod runs meanwhile);
3. **run**, the stream: the pod started again on the same directory (a restart to ready, with the checkpoint),
   then the stream's records decided from that moment until every create's outcome is written:
   events/s, process CPU per event, the event loop's busy time per turn (:mod:`.loop_turns`) and the
   pod's own turns (``Turns.turn``, timed around the instance's method);
4. **reaper**: the pod's own reaper (``reaper_for``, as ``SANDBOX_LANES_REAP_INTERVAL_S`` runs it) run
   ``passes`` times over the memory driver's listing (the same at every size): ``listed`` sandboxes of
   held states (a point lookup each), quiet sessions (nothing read, retention on) and finished
   executions' sandboxes (reaped, each in its turn of the effect runner); then once more with a deleted
   session's sandbox listed, whose references are read (from the session index since format 3; its
   partition was read through before: the worst case):
   each pass's seconds and the longest turn of the loop while it ran;
5. **restarted**: stopped and started once more on the same directory (a restart after work).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from sandbox_lanes_bench.common import child_process

MIB = 1024 * 1024
#: The listing's ids (the parent writes their states into the topic with the held ones).
HELD_ID = "exec-{:08d}"
DONE_ID = "scale-done-{:03d}"
QUIET_ID = "scale-ses-{}"
DELETED_ID = "scale-ses-deleted"
QUIET_SESSIONS = 5


def pod_child(spec: dict[str, Any], conn: Any) -> None:
    """Child process entry point: the steps above, then the pipe closed."""
    child_process(_run, spec, conn)


class _PodRun:
    """One pod composed from ``env`` and running, its turns timed into ``pod_turns``."""

    def __init__(self, env: dict[str, str], provisioner: Any, pod_turns: list[float]) -> None:
        self.env = env
        self.provisioner = provisioner
        self.pod_turns = pod_turns
        self.composed: Any = None
        self.task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> float:
        """Compose and run the pod; seconds until it is ready."""
        from consumers.ops.compose import compose
        from consumers.ops.settings import load_settings

        started = time.perf_counter()
        self.composed = compose(
            load_settings(self.env), logging.getLogger("sandbox_lanes"), provisioner=self.provisioner
        )
        pod = self.composed.pod
        turn = pod.turns.turn

        async def timed_turn(fetched: Any) -> None:
            began = time.perf_counter()
            try:
                await turn(fetched)
            finally:
                if any(fetched.values()):  # a turn deciding records (not one only folding results back)
                    self.pod_turns.append(time.perf_counter() - began)

        pod.turns.turn = timed_turn
        self.task = asyncio.create_task(pod.run())
        ready = asyncio.ensure_future(pod.ready.wait())
        done, _ = await asyncio.wait(
            {ready, self.task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if self.task in done:
            ready.cancel()
            self.task.result()
            raise RuntimeError("the pod stopped before it was ready")
        if ready not in done:
            ready.cancel()
            raise TimeoutError(f"the pod was not ready in {timeout_s:.0f} s")
        return time.perf_counter() - started

    async def stop(self) -> None:
        if self.task is None:
            return
        self.composed.pod.request_stop()
        await asyncio.wait_for(self.task, 120)
        self.task = None

    @property
    def pod(self) -> Any:
        return self.composed.pod


def _outputs(pod: Any) -> int:
    return sum(pod.stats.outputs.values())


async def _stream(run: _PodRun, turns: Any, gcs: Any, events: int, timeout_s: float) -> dict[str, Any]:
    """From ready until every create's outcome is written: rate, CPU (the process's, and the loop
    thread's alone: RocksDB's flushes and compactions run on threads of their own), the loop's and the
    pod's turns, the collector's longest pause. The memory driver's call log is emptied as it goes
    (it keeps every call for the tests: not the pod's heap)."""
    from sandbox_lanes_bench.common import read_status
    from sandbox_lanes_bench.loop_turns import turn_figures

    pod = run.pod
    mark, gc_mark = turns.mark(), gcs.mark()
    run.pod_turns.clear()
    cpu, thread_cpu = time.process_time(), time.thread_time()
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    ensures = 0
    while _outputs(pod) < events:
        if pod.stats.dead_lettered:
            raise RuntimeError(f"{pod.stats.dead_lettered} of the stream's records dead-lettered")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_outputs(pod)}/{events} outcomes in {timeout_s:.0f} s")
        await asyncio.sleep(0.005)
        if len(run.provisioner.calls) > 1000:
            ensures += run.provisioner.count("ensure")
            run.provisioner.calls.clear()
    seconds = time.perf_counter() - started
    cpu_s, loop_cpu_s = time.process_time() - cpu, time.thread_time() - thread_cpu
    ensures += run.provisioner.count("ensure")
    loop = turn_figures(turns.since(mark))
    loop_cpu = turn_figures(turns.cpu_since(mark))
    own = turn_figures(run.pod_turns)
    return {
        "stream_seconds": seconds,
        "events_per_s": events / seconds,
        "cpu_us_per_event": cpu_s * 1e6 / events,
        "loop_cpu_us_per_event": loop_cpu_s * 1e6 / events,
        "stream_gc_longest_ms": gcs.longest_since(gc_mark) * 1000,
        "ensures": float(ensures),
        "cpu_cores": cpu_s / seconds,
        "loop_turn_p50_ms": loop["p50_ms"],
        "loop_turn_p99_ms": loop["p99_ms"],
        "loop_turn_max_ms": loop["max_ms"],
        "loop_turns": loop["turns"],
        "loop_turn_cpu_p50_ms": loop_cpu["p50_ms"],
        "loop_turn_cpu_p99_ms": loop_cpu["p99_ms"],
        "loop_turn_cpu_max_ms": loop_cpu["max_ms"],
        "pod_turn_p50_ms": own["p50_ms"],
        "pod_turn_p99_ms": own["p99_ms"],
        "pod_turn_max_ms": own["max_ms"],
        "pod_turns": own["turns"],
        "rss_after_stream_mib": read_status("VmRSS") / MIB,
        **_heap(),
    }


def _heap(top: int = 8) -> dict[str, Any]:
    """What the collector walks in a full collection after the stream: the objects it tracks, and
    the most numerous types among them (what a long pause of the collector is made of)."""
    import collections
    import gc

    tracked = gc.get_objects()
    kinds = collections.Counter(_type_name(type(o)) for o in tracked)
    return {"heap_objects": float(len(tracked)), "heap_top_types": dict(kinds.most_common(top))}


def _type_name(kind: type) -> str:
    module = kind.__dict__.get("__module__", "")  # a metaclass's attribute may stand in for it
    return f"{module}.{kind.__qualname__}" if isinstance(module, str) and module else kind.__qualname__


def _list(provisioner: Any, spec: dict[str, Any], deleted: bool) -> None:
    """What the driver lists for a pass, the same at every size: the stream's sandboxes are not
    listed (the memory driver's own listing of 20k, synchronous, held the loop 50-150 ms by itself)."""
    live = provisioner.live
    live.clear()
    for i in range(spec["listed"]):
        live[("workflow", HELD_ID.format(i))] = "running"
    for i in range(QUIET_SESSIONS):
        live[("session", QUIET_ID.format(i))] = "running"
    for i in range(spec["candidates"]):  # reaped by each pass, listed again for the next
        live[("workflow", DONE_ID.format(i))] = "running"
    if deleted:
        live[("session", DELETED_ID)] = "running"


async def fresh_marks(turns: Any, gcs: Any) -> tuple[int, int]:
    """Marks (:class:`~.loop_turns.LoopTurns`, :class:`~.loop_turns.GcPauses`) that open a window in a
    turn of its own. A turn is recorded when it ends, so marks taken in the turn the caller is in would
    count that turn's earlier work in the window's first turn: before a process's first reaper pass,
    the bench's own (the stream's figures, the settings loaded for ``reaper_for``, the memory driver's
    listing of the stream's 50k sandboxes cleared by :func:`_list`). Measured after a 50k-create stream:
    that work was the first pass's whole longest hold (12.5 ms of the loop thread's CPU; each later
    pass's 0.6 ms), while the pod's own first pass, run by its periodic reaper, held no turn over 0.9 ms."""
    await asyncio.sleep(0)  # the caller's turn ends (and is recorded) before the marks
    return turns.mark(), gcs.mark()


async def _reaper_passes(run: _PodRun, turns: Any, gcs: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The pod's own reaper, ``passes`` times as it lists by default, then once with a deleted session."""
    from consumers.ops.reaper import reaper_for
    from consumers.ops.settings import load_settings

    reaper = reaper_for(load_settings(run.env), run.composed)
    if reaper is None:
        raise RuntimeError("no reaper: the pod has no driver")
    passes: list[dict[str, float]] = []
    for i in range(spec["passes"] + 1):
        deleted = i == spec["passes"]
        _list(run.provisioner, spec, deleted)
        run.provisioner.calls.clear()
        mark, gc_mark = await fresh_marks(turns, gcs)
        started = time.perf_counter()
        report = await reaper.run_once(apply=True)
        seconds = time.perf_counter() - started
        busy, cpu = turns.since(mark), turns.cpu_since(mark)
        if report.failed:
            raise RuntimeError(f"reaper pass: {report.failed} removals failed")
        passes.append(
            {
                "seconds": seconds,
                "longest_hold_ms": max(busy) * 1000 if busy else 0.0,
                "longest_hold_cpu_ms": max(cpu) * 1000 if cpu else 0.0,
                "gc_longest_ms": gcs.longest_since(gc_mark) * 1000,
                "listed": float(len(report.results)),
                "candidates": float(report.candidates),
                "removed": float(report.removed),
                "states": float(report.states),
                "read_through": float(deleted),
            }
        )
    return {"passes": passes}


async def _compactions_settled(states: Any, timeout_s: float) -> float:
    """Seconds until RocksDB has no compaction pending or running in any partition's database: what a
    restore from empty leaves to do in the background (10M states written in key order by the topic's
    partition, flushed into many overlapping level-0 files). Waited for here, so the rounds measure
    the store as it stands once settled, not the restore's tail (the rounds' first ran 0.90 x the
    empty store where the next two ran 0.96 x)."""
    started = time.monotonic()
    while states.compactions_busy() and time.monotonic() - started < timeout_s:
        await asyncio.sleep(0.5)
    return time.monotonic() - started


def _disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


async def _run(spec: dict[str, Any], conn: Any) -> None:
    """``spec["step"]``: ``restore`` (step 1, a process of its own) or ``run`` (steps 3-5)."""
    from sandbox_lanes_bench.common import memory_provisioner, read_status
    from sandbox_lanes_bench.loop_turns import GcPauses, LoopTurns

    loop = asyncio.get_running_loop()
    provisioner = memory_provisioner()
    pod_turns: list[float] = []
    env: dict[str, str] = spec["env"]
    with LoopTurns(loop) as turns, GcPauses() as gcs:
        if spec["step"] == "restore":
            first = _PodRun(env, provisioner, pod_turns)
            restore_s = await first.start(spec["restore_timeout_s"])
            held = len(first.pod.states)
            rss_held = read_status("VmRSS") / MIB
            settle_s = await _compactions_settled(first.pod.states, spec["restore_timeout_s"])
            await first.stop()
            conn.send(
                {
                    "restore_from_empty_s": restore_s,
                    "compaction_after_restore_s": settle_s,
                    "states_held": held,
                    "rss_restore_mib": rss_held,
                }
            )
            return
        run = _PodRun(env, provisioner, pod_turns)
        mark = turns.mark()
        restart_before = await run.start(spec["restart_timeout_s"])
        holds = [max(turns.since(mark), default=0.0)]
        holds_cpu = [max(turns.cpu_since(mark), default=0.0)]
        rss_ready = read_status("VmRSS") / MIB
        try:
            stream = await _stream(run, turns, gcs, spec["events"], spec["stream_timeout_s"])
            reaper = await _reaper_passes(run, turns, gcs, spec)
        finally:
            await run.stop()
        again = _PodRun(env, provisioner, pod_turns)
        mark = turns.mark()
        restart_after = await again.start(spec["restart_timeout_s"])
        holds.append(max(turns.since(mark), default=0.0))
        holds_cpu.append(max(turns.cpu_since(mark), default=0.0))
        held_after = len(again.pod.states)
        await again.stop()
    conn.send(
        {
            **stream,
            **reaper,
            "rss_ready_mib": rss_ready,
            "restart_to_ready_s": [restart_before, restart_after],
            "restart_longest_hold_ms": max(holds) * 1000,
            "restart_longest_hold_cpu_ms": max(holds_cpu) * 1000,
            "states_held_after": float(held_after),
            "rss_peak_mib": read_status("VmHWM") / MIB,
            "disk_mib": _disk_bytes(Path(env["SANDBOX_LANES_STATE_DIR"])) / MIB,
        }
    )
