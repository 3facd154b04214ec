"""A barrier for "nothing extra happened" checks: sentinel events whose outcome proves the pod got past
every record produced before them, instead of a fixed sleep.

For each partition of the execution-created and phase-changed topics, a sentinel (a LOCAL workflow:
no driver call, no outcome record) is produced behind the records under test; a partition's records
are applied in order, so once the sentinel's state is committed (read_committed) so is every decision
before it on that partition. Then the barrier waits until no state holds a pending driver call: every
outcome those decisions lead to is committed too. What the topics hold after it is final.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiokafka.partitioner import DefaultPartitioner

from consumers.ops.settings import load_settings
from events.codec import OUTCOME_TYPES, decode, decode_state, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import Received, produce

SENTINEL_PREFIX = "wfx_barrier_"


def _partition(key: str, partitions: int) -> int:
    return DefaultPartitioner()(key.encode(), list(range(partitions)), list(range(partitions)))


def sentinel_ids(partitions: int) -> list[str]:
    """One fresh execution id per partition (by the producers' default partitioner)."""
    run = uuid.uuid4().hex[:8]
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        key = f"{SENTINEL_PREFIX}{run}_{i}"
        found.setdefault(_partition(key, partitions), key)
        i += 1
    return [found[p] for p in range(partitions)]


async def _latest_states(bootstrap: str, topic: str) -> dict[str, state_pb2.ExecutionState]:
    states: dict[str, state_pb2.ExecutionState] = {}
    for rec in await read_all(bootstrap, topic):
        if rec.key is not None and rec.value is not None:
            states[rec.key.decode()] = decode_state(rec.value)
    return states


async def _until(bootstrap: str, topic: str, done: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = await _latest_states(bootstrap, topic)
        if done(states):  # type: ignore[operator]
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier: {what} not seen in {timeout_s:g}s")
        await asyncio.sleep(0.3)


async def barrier(bootstrap: str, env: dict[str, str], timeout_s: float = 60.0) -> None:
    """Return once the pod has applied everything produced before this call and folded every result."""
    settings = load_settings(env)
    topics = settings.topics
    ids = sentinel_ids(settings.partitions)
    created = [
        inputs_pb2.ExecutionCreated(
            meta=new_meta(),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id=key,
            workflow_execution_target=common_pb2.LOCAL,
        )
        for key in ids
    ]
    await produce(bootstrap, env, *created)
    await _until(bootstrap, topics.state, lambda s: all(k in s for k in ids), timeout_s, "sentinel creates")
    # Only now the phase changes: one produced before its create was applied would be dead-lettered.
    phases = [
        inputs_pb2.PhaseChanged(
            meta=new_meta(),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id=key,
            previous_phase=common_pb2.EXECUTION_PENDING,
            new_phase=common_pb2.EXECUTION_IN_PROGRESS,
        )
        for key in ids
    ]
    await produce(bootstrap, env, *phases)
    seen = {p.execution_id: p.meta.event_id for p in phases}
    await _until(
        bootstrap,
        topics.state,
        lambda s: all(k in s and seen[k] in s[k].applied_event_ids for k in ids),
        timeout_s,
        "sentinel phase changes",
    )
    await _until(
        bootstrap,
        topics.state,
        lambda s: not any(st.pending for st in s.values()),
        timeout_s,
        "every driver call folded back",
    )


def without_sentinels(states: dict[str, state_pb2.ExecutionState]) -> dict[str, state_pb2.ExecutionState]:
    return {k: v for k, v in states.items() if not k.startswith(SENTINEL_PREFIX)}


async def read_settled(bootstrap: str, topic: str) -> list[Received]:
    """Everything ``topic`` holds (read_committed, to its end offsets), outcomes decoded: after
    :func:`barrier`, this is final."""
    out: list[Received] = []
    for rec in await read_all(bootstrap, topic):
        raw_headers = [(k, v.encode()) for k, v in rec.headers.items()]
        message = None
        if "dlq_reason" not in rec.headers and rec.headers.get("ce_type") in OUTCOME_TYPES:
            message = decode(rec.key, rec.value, raw_headers, allowed=OUTCOME_TYPES)
        key = rec.key.decode() if rec.key else ""
        out.append(Received(topic, key, message, dict(rec.headers), rec.value, rec.partition))
    return out
