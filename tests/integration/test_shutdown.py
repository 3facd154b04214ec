"""Graceful shutdown: SIGTERM to `sandbox-lanes run` under load loses nothing and does nothing twice.

The first pod gets SIGTERM while events are still being produced; it must exit 0
within SANDBOX_LANES_SHUTDOWN_TIMEOUT_S. A second pod finishes the rest. Then every
execution has exactly one outcome and no outcome id appears twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from consumers.ops.settings import load_settings
from events.codec import OUTCOME_TYPES, decode, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import PodProcess, Received, produce, read_topic, unique_env
from tests.support.proc_util import runner_pids

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]
RUN = uuid.uuid4().hex[:8]
BOUND_S = 10.0
#: Interpreter start-up/exit around the pod's own bound.
SLACK_S = 4.0


def created(execution_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id=f"evt-{execution_id}"),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
        caller_identity_id="ida_shutdown",
    )


async def _produce_paced(bootstrap: str, topic: str, ids: list[str], per_tick: int, tick_s: float) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        for start in range(0, len(ids), per_tick):
            futures = []
            for execution_id in ids[start : start + per_tick]:
                record = encode(created(execution_id), source="test-load")
                futures.append(
                    await producer.send(topic, record.value, key=record.key, headers=record.headers)
                )
            await asyncio.gather(*futures)
            await asyncio.sleep(tick_s)
    finally:
        await producer.stop()


async def _committed(bootstrap: str, topic: str) -> list[Received]:
    """Every committed record of ``topic``, read up to its last stable offset (after the pods have
    exited that is everything they will ever write: no quiet period decides it)."""
    out = []
    for r in await read_all(bootstrap, topic):
        headers = [(k, v.encode()) for k, v in r.headers.items()]
        message = (
            None if "dlq_reason" in r.headers else decode(r.key, r.value, headers, allowed=OUTCOME_TYPES)
        )
        out.append(Received(topic, (r.key or b"").decode(), message, r.headers, r.value, r.partition))
    return out


def _check_exactly_once(outcomes: list[Received], ids: list[str]) -> Counter[str]:
    per_execution = Counter(r.message.execution_id for r in outcomes)  # type: ignore[union-attr]
    assert set(per_execution) == set(ids), f"missing: {sorted(set(ids) - set(per_execution))[:5]}"
    twice = [k for k, n in per_execution.items() if n != 1]
    assert twice == [], f"executions with more than one outcome: {twice[:5]}"
    ce_ids = Counter(r.headers["ce_id"] for r in outcomes)
    assert [k for k, n in ce_ids.items() if n > 1] == []
    return Counter(r.headers["ce_source"] for r in outcomes)


def _stopped_cleanly(pod: PodProcess) -> None:
    lines = [json.loads(line) for line in pod.log().splitlines() if line.startswith("{")]
    messages = [line["msg"] for line in lines]
    assert "pod stopped" in messages, pod.log()[-3000:]
    assert "shutdown bound reached, handing the work in flight back" not in messages
    errors = [
        line for line in lines if line["level"] == "error" and line["logger"].startswith("sandbox_lanes")
    ]
    assert errors == []


async def test_sigterm_under_load_loses_nothing_and_does_nothing_twice(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_SHUTDOWN_TIMEOUT_S=str(BOUND_S),
        SANDBOX_LANES_REAP_INTERVAL_S="0",
        SANDBOX_LANES_HTTP_PORT="0",
    )
    topics = load_settings(env).topics
    ids = [f"wfx_load_{RUN}_{i:04d}" for i in range(2000)]
    first = PodProcess(env, tmp_path / "pod-a.log")
    first.start()
    await first.wait_for_log("state restored")
    load = asyncio.create_task(_produce_paced(kafka_bootstrap, topics.execution_created, ids, 25, 0.05))
    # SIGTERM while the load is still coming in and the pod is busy with it.
    await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, settle_s=0, timeout_s=20)
    await asyncio.sleep(0.5)
    assert not load.done(), "the load finished before SIGTERM; make it longer"
    code, seconds = await asyncio.to_thread(first.terminate, BOUND_S + SLACK_S + 5)
    assert code == 0, first.log()[-3000:]
    assert seconds <= BOUND_S + SLACK_S, f"shutdown took {seconds:.1f}s"
    _stopped_cleanly(first)
    await load

    second = PodProcess({**env, "SANDBOX_LANES_POD_ID": "pod-b"}, tmp_path / "pod-b.log")
    second.start()
    try:
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=len(ids), timeout_s=120, settle_s=0)
    finally:
        code, _ = await asyncio.to_thread(second.terminate)
    assert code == 0
    # Both pods have exited: what the topics hold now is all they wrote.
    sources = _check_exactly_once(await _committed(kafka_bootstrap, topics.outcomes), ids)
    assert sources["sandbox-lanes/pod-a"] > 0 and sources["sandbox-lanes/pod-b"] > 0, sources
    assert sum(sources.values()) == len(ids)
    assert await read_all(kafka_bootstrap, topics.dead_letter) == []


async def test_sigterm_with_real_runner_processes_hands_back_and_provisions_each_once(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_SHUTDOWN_TIMEOUT_S=str(BOUND_S),
        SANDBOX_LANES_REAP_INTERVAL_S="0",
        SANDBOX_LANES_HTTP_PORT="0",
    )
    topics = load_settings(env).topics
    ids = [f"wfx_term_{RUN}_{i:02d}" for i in range(12)]
    first = PodProcess(env, tmp_path / "pod-a.log")
    first.start()
    await first.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(created(i) for i in ids))
    await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, settle_s=0, timeout_s=30)
    code, seconds = await asyncio.to_thread(first.terminate, BOUND_S + SLACK_S + 5)
    assert code == 0 and seconds <= BOUND_S + SLACK_S, (code, seconds, first.log()[-3000:])
    _stopped_cleanly(first)

    second = PodProcess({**env, "SANDBOX_LANES_POD_ID": "pod-b"}, tmp_path / "pod-b.log")
    second.start()
    try:
        outcomes = await read_topic(
            kafka_bootstrap, topics.outcomes, at_least=len(ids), timeout_s=90, settle_s=0
        )
        assert {r.message.execution_id for r in outcomes} == set(ids)  # type: ignore[union-attr]
        assert all(len(runner_pids(f"wfexec:{i}")) == 1 for i in ids)  # one real runner each
        await produce(
            kafka_bootstrap,
            env,
            *(
                inputs_pb2.PhaseChanged(
                    meta=new_meta(),
                    kind=common_pb2.WORKFLOW_EXECUTION,
                    execution_id=i,
                    previous_phase=common_pb2.EXECUTION_PENDING,
                    new_phase=common_pb2.EXECUTION_COMPLETED,
                )
                for i in ids
            ),
        )
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2 * len(ids), timeout_s=90, settle_s=0)
        deadline = time.monotonic() + 15  # a torn-down runner may take a moment to be reaped
        while (left := [i for i in ids if runner_pids(f"wfexec:{i}")]) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert left == []
    finally:
        code, _ = await asyncio.to_thread(second.terminate)
    assert code == 0
    # The second pod has exited: one provision and one teardown each, nothing twice.
    everything = await _committed(kafka_bootstrap, topics.outcomes)
    assert len(everything) == 2 * len(ids)
    provisions = [
        r for r in everything if type(r.message).__name__ in ("SandboxProvisioned", "SandboxFailed")
    ]
    _check_exactly_once(provisions, ids)
