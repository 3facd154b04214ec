"""The installation's cap held across pods and partitions, on a real broker (issue 44, items 1-5).

Two pods of one installation (in one process, so the test can watch the one engine they share: a
memory driver whose live sandboxes the test samples every 20 ms, not the pods' own counts), a cap
of 3 and 16 workflow creates from 2 organisations at once, all on the inputs' partitions. Each
execution completes shortly after its sandbox is provisioned, so sandboxes end and the waiting ones
are admitted. The verdicts: the engine never held more than the cap and did reach it (capacity not
stranded), every execution was provisioned once and torn down once, the waiting ones were told
(``SandboxQueued``), and ``replay`` re-derives every admission from the capacity log and every
decision with them, with no divergence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.partitioner import murmur2
from harness.memory_driver import MemoryProvisioner

from consumers.ops.settings import load_settings
from consumers.tools.explain import explain, render_text
from consumers.tools.replay import lane_config, replay
from consumers.tools.replay.command import summary_table
from events.codec import OUTCOME_TYPES, decode
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.pod_harness import produce, read_topic, running_pod, unique_env, wf_created, wf_terminal

pytestmark = pytest.mark.kafka

CAP = 3
CREATES = 16


async def _outcomes_until(
    bootstrap: str, topic: str, done: asyncio.Event, on_outcome: Any, timeout_s: float
) -> None:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not done.is_set() and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for rec in records:
                    await on_outcome(decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES))
    finally:
        await consumer.stop()


@pytest.mark.timeout(240)
async def test_two_pods_never_hold_more_sandboxes_than_the_cap_and_every_create_runs_once(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="2",
        SANDBOX_LANES_MAX_SANDBOXES=str(CAP),
        SANDBOX_LANES_ADMISSION_TIMEOUT_S="120",
    )
    topics = load_settings(env).topics
    engine = MemoryProvisioner(ensure_latency_ms=30, teardown_latency_ms=30)
    most = 0
    sampling = True

    async def sample() -> None:
        nonlocal most
        while sampling:
            most = max(most, len(engine.live))
            await asyncio.sleep(0.02)

    run = uuid.uuid4().hex[:6]
    ids = [f"wf-cap-{run}-{i}" for i in range(CREATES)]
    creates = []
    for i, execution_id in enumerate(ids):
        created = wf_created(execution_id)
        created.org = "org-big" if i % 4 else "org-small"
        creates.append(created)
    provisioned: Counter[str] = Counter()
    deprovisioned: Counter[str] = Counter()
    queued: Counter[str] = Counter()
    done = asyncio.Event()
    completing: list[asyncio.Task[None]] = []

    async def complete_later(execution_id: str) -> None:
        await asyncio.sleep(0.3)  # the execution runs a moment, then ends
        await produce(kafka_bootstrap, env, wf_terminal(execution_id))

    async def on_outcome(message: Any) -> None:
        if isinstance(message, outcomes_pb2.SandboxProvisioned):
            provisioned[message.execution_id] += 1
            completing.append(asyncio.create_task(complete_later(message.execution_id)))
        elif isinstance(message, outcomes_pb2.SandboxDeprovisioned):
            deprovisioned[message.execution_id] += 1
            if len(deprovisioned) == CREATES:
                done.set()
        elif isinstance(message, outcomes_pb2.SandboxQueued):
            queued[message.execution_id] += 1
            assert message.reason == f"capacity: installation cap {CAP} reached", message.reason

    sampler = asyncio.create_task(sample())
    env_b = {**env, "SANDBOX_LANES_POD_ID": "pod-b"}
    try:
        async with running_pod(env, provisioner=engine), running_pod(env_b, provisioner=engine):
            watcher = asyncio.create_task(
                _outcomes_until(kafka_bootstrap, topics.outcomes, done, on_outcome, timeout_s=180)
            )
            await produce(kafka_bootstrap, env, *creates)
            await asyncio.wait_for(done.wait(), 180)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await asyncio.gather(*completing)
    finally:
        sampling = False
        await sampler
    print(f"\nengine held at most {most} sandboxes (cap {CAP}); {len(queued)} creates were told they wait")
    assert most <= CAP, f"the engine held {most} sandboxes, over the cap of {CAP}"
    assert most == CAP, f"the engine never held the cap's {CAP} sandboxes at once: capacity stranded"
    assert provisioned == Counter({e: 1 for e in ids}), provisioned
    assert deprovisioned == Counter({e: 1 for e in ids}), deprovisioned
    assert engine.count("ensure") == CREATES and engine.count("deprovision") == CREATES
    assert len(queued) >= CREATES - CAP - CAP  # at least those past two rounds of the cap waited

    # Replay, as an auditor runs it: every admission re-derived from the capacity log alone and
    # every execution's decisions with them, against what the pods recorded.
    settings = load_settings(env)
    report = await replay(kafka_bootstrap, topics, lane_config(settings, "memory"), show_progress=False)
    print(summary_table(report))
    assert not report.diverged, [d.as_dict() for d in report.divergences][:5]
    assert report.capacity_answers_recorded == report.capacity_answers_matched >= CREATES

    # explain tells one waiting execution's story: asked, told it waits (where), admitted, ran, ended.
    waited = sorted(queued)[0]
    story = await explain(kafka_bootstrap, topics, lane_config(settings, "memory"), waited)
    rules = [step["rule"] for step in story["steps"]]
    assert rules[:3] == ["workflow lane", "capacity: waits", "capacity: admitted"], rules
    text = render_text(story)
    assert (
        f"capacity: installation cap {CAP} reached" in text and "its place among the creates waiting" in text
    ), text


def _on_partition(prefix: str, partition: int, partitions: int, n: int) -> list[str]:
    """``n`` execution ids whose records the producers' partitioner (murmur2 of the key, as Java's and
    aiokafka's) puts on ``partition``."""
    ids: list[str] = []
    i = 0
    while len(ids) < n:
        candidate = f"{prefix}-{i}"
        if (murmur2(candidate.encode()) & 0x7FFFFFFF) % partitions == partition:
            ids.append(candidate)
        i += 1
    return ids


@pytest.mark.timeout(180)
async def test_with_all_the_load_on_one_partition_that_partition_uses_the_whole_cap(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Capacity is not stranded: the cap is the installation's, not split by partition (4 here)."""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_PARTITIONS="4",
        SANDBOX_LANES_MAX_SANDBOXES="8",
    )
    topics = load_settings(env).topics
    engine = MemoryProvisioner()
    ids = _on_partition(f"wf-one-{uuid.uuid4().hex[:6]}", 1, 4, 12)
    async with running_pod(env, provisioner=engine):
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in ids))
        deadline = time.monotonic() + 60
        while len(engine.live) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        held = len(engine.live)
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=12, settle_s=0.5)
    created = await read_topic(kafka_bootstrap, topics.execution_created, at_least=12, settle_s=0.2)
    assert {r.partition for r in created} == {1}  # the premise: every create on one partition
    print(f"\none partition of 4 held {held} sandboxes of a cap of 8")
    assert held == 8, f"one partition held {held} of a cap of 8: capacity stranded"
    kinds = Counter(type(o.message).__name__ for o in outcomes)
    assert kinds == Counter({"SandboxProvisioned": 8, "SandboxQueued": 4}), kinds


@pytest.mark.timeout(180)
async def test_a_create_that_waits_past_the_admission_timeout_fails_as_its_lane_does(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Cap 1, a 2 s admission time-out: the first workflow runs on, the second waits and then fails
    the workflow lane's way (SandboxFailed, critical, its reason starting ``capacity:``)."""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_MAX_SANDBOXES="1",
        SANDBOX_LANES_ADMISSION_TIMEOUT_S="2",
    )
    topics = load_settings(env).topics
    run = uuid.uuid4().hex[:6]
    first, second = f"wf-to-{run}-1", f"wf-to-{run}-2"
    async with running_pod(env, provisioner=MemoryProvisioner()):
        await produce(kafka_bootstrap, env, wf_created(first))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, settle_s=0.1)
        await produce(kafka_bootstrap, env, wf_created(second))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=3, timeout_s=60, settle_s=0.5)
    by_execution = {(o.message.execution_id, type(o.message).__name__): o.message for o in outcomes}
    assert set(by_execution) == {
        (first, "SandboxProvisioned"),
        (second, "SandboxQueued"),
        (second, "SandboxFailed"),
    }, sorted(by_execution)
    failed = by_execution[(second, "SandboxFailed")]
    assert failed.critical and failed.reason.startswith("capacity: waited "), failed.reason
    assert failed.message == "failed to provision workflow sandbox"
