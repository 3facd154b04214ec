"""Driver calls off the transaction, through a real broker: slow calls never hold a transaction,
calls for one execution stay in order, a full pool pauses fetching, a crashed pod's pending
calls are finished by the next owner with one outcome each."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from harness.memory_driver import MemoryProvisioner

from consumers.ops.settings import load_settings
from consumers.runtime.effects import EffectRunner
from events.codec import OUTCOME_TYPES, decode
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import (
    PodProcess,
    Received,
    latest_states,
    produce,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
    wf_terminal,
)

pytestmark = [pytest.mark.kafka]

RUN = uuid.uuid4().hex[:8]


def memory_env(bootstrap: str, tmp: Path, **overrides: str) -> dict[str, str]:
    return unique_env(bootstrap, tmp, SANDBOX_PROVISIONER_TYPE="memory", **overrides)


def peak_outstanding(effects: EffectRunner) -> list[int]:
    """The most calls ever out at once (queued, running or not yet folded), exact: only a submit
    adds one, so the maximum is read right after each submit (no sampling that could miss it)."""
    peak = [0]
    submit = effects.submit

    def counted(*args: Any, **kwargs: Any) -> bool:
        accepted = submit(*args, **kwargs)
        peak[0] = max(peak[0], effects.outstanding)
        return accepted

    effects.submit = counted  # type: ignore[method-assign]
    return peak


async def committed_outcomes(bootstrap: str, topic: str) -> list[Received]:
    """Every committed outcome, read up to the topic's last stable offset (once the pod has stopped,
    all it wrote: no quiet period decides it)."""
    out = []
    for r in await read_all(bootstrap, topic):
        headers = [(k, v.encode()) for k, v in r.headers.items()]
        message = decode(r.key, r.value, headers, allowed=OUTCOME_TYPES)
        out.append(Received(topic, (r.key or b"").decode(), message, r.headers, r.value, r.partition))
    return out


def assert_one_outcome_each(outcomes: list, executions: list[str], kind: type) -> None:  # type: ignore[type-arg]
    ids = Counter(r.message.meta.event_id for r in outcomes)
    assert [i for i, n in ids.items() if n > 1] == [], "an outcome id was written twice"
    per_execution = Counter(r.message.execution_id for r in outcomes if isinstance(r.message, kind))
    assert per_execution == Counter(executions), per_execution


async def test_driver_calls_longer_than_the_transaction_timeout_run_concurrently_and_all_complete(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # 60 ensures of 2 s each: one after the other inside the transaction (the old design) that is
    # 120 s against a 5 s transaction timeout; off the transaction, 16 at a time, about 8 s.
    env = memory_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_TRANSACTION_TIMEOUT_MS="5000",
        SANDBOX_LANES_DRIVER_CONCURRENCY="16",
    )
    topics = load_settings(env).topics
    driver = MemoryProvisioner(ensure_latency_ms=2000)
    executions = [f"wfx_slow_{RUN}_{i}" for i in range(60)]
    async with running_pod(env, provisioner=driver) as composed:
        peak = peak_outstanding(composed.pod.effects)
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=60, timeout_s=90, settle_s=0)
        assert composed.pod.stats.commit_failures == 0
    outcomes = await committed_outcomes(kafka_bootstrap, topics.outcomes)  # the pod has stopped
    assert_one_outcome_each(outcomes, executions, outcomes_pb2.SandboxProvisioned)
    assert peak[0] > 16  # calls were out while the pod went on deciding (16 running, more queued)
    assert driver.count("ensure") == 60
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=120))
    assert all(not states[e].pending for e in executions)


async def test_a_terminal_phase_during_the_ensure_tears_down_after_it(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = memory_env(kafka_bootstrap, tmp_path)
    topics = load_settings(env).topics
    driver = MemoryProvisioner(ensure_latency_ms=1500)
    execution = f"wfx_order_{RUN}"
    async with running_pod(env, provisioner=driver):
        await produce(kafka_bootstrap, env, wf_created(execution), wf_terminal(execution))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2, timeout_s=30)
    assert [type(r.message).__name__ for r in outcomes] == ["SandboxProvisioned", "SandboxDeprovisioned"]
    assert [c.op for c in driver.calls] == ["ensure", "deprovision"]
    assert driver.live == {}


async def test_a_full_driver_pool_pauses_fetching_instead_of_buffering(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Pause at max(4 x concurrency, 4 x max batch) = 20 calls out; resume below 5.
    caplog.set_level(logging.INFO, logger="sandbox_lanes.pod")
    env = memory_env(
        kafka_bootstrap, tmp_path, SANDBOX_LANES_DRIVER_CONCURRENCY="2", SANDBOX_LANES_MAX_BATCH="5"
    )
    topics = load_settings(env).topics
    driver = MemoryProvisioner(ensure_latency_ms=100)
    executions = [f"wfx_bp_{RUN}_{i}" for i in range(80)]
    async with running_pod(env, provisioner=driver) as composed:
        peak = peak_outstanding(composed.pod.effects)
        await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=80, timeout_s=90, settle_s=0)
    outcomes = await committed_outcomes(kafka_bootstrap, topics.outcomes)  # the pod has stopped
    assert_one_outcome_each(outcomes, executions, outcomes_pb2.SandboxProvisioned)
    # Bounded: the threshold plus at most one fetch per partition decided before the pause.
    assert 20 <= peak[0] <= 20 + 2 * 5, peak
    assert "driver calls backing up, pausing fetch" in caplog.text
    assert "driver calls caught up, fetching again" in caplog.text


async def test_a_pod_killed_with_calls_pending_hands_them_to_the_next_owner_one_outcome_each(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = memory_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_DRIVER_OPTIONS="ensure_latency_ms=60000")
    topics = load_settings(env).topics
    executions = [f"wfx_handover_{RUN}_{i}" for i in range(10)]
    first = PodProcess(env, tmp_path / "pod-1.log")
    first.start()
    await first.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in executions))
    # The decisions are committed (pending entries in the state topic); the calls hang in the driver.
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=10, timeout_s=30))
    assert all(len(states[e].pending) == 1 for e in executions)
    first.kill9()
    assert await read_topic(kafka_bootstrap, topics.outcomes, settle_s=0.5, timeout_s=2) == []

    second = PodProcess(
        {**env, "SANDBOX_LANES_POD_ID": "pod-b", "SANDBOX_LANES_DRIVER_OPTIONS": "ensure_latency_ms=50"},
        tmp_path / "pod-2.log",
    )
    second.start()
    try:
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=10, timeout_s=60)
        await second.wait_for_log("outbox resumed")
    finally:
        code, _ = second.terminate()
    assert code == 0
    assert_one_outcome_each(outcomes, executions, outcomes_pb2.SandboxProvisioned)
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=20))
    assert all(not states[e].pending for e in executions)


async def test_records_fetched_while_the_take_over_still_fences_wait_for_the_fence(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking a partition over fences the previous writer first, and InitProducerId can wait out
    its open transaction (here: 3 s). Two things must hold meanwhile. The group must keep the
    pod: aiokafka sends no heartbeat until the assignment callback returns, so a take-over
    inside the callback outlived the session timeout (6 s here with the 3 s heartbeat) and the
    pod was expelled on every rejoin, forever. And the partition's records and outbox must wait
    for the take-over: aiokafka hands out the records before the callback ends, and a restore
    they triggered resumed the outbox under an ownership epoch the take-over then voided (seen
    in the chaos run: pending entries never folded back)."""
    env = memory_env(kafka_bootstrap, tmp_path, SANDBOX_LANES_DRIVER_OPTIONS="ensure_latency_ms=60000")
    topics = load_settings(env).topics
    pending = [f"wfx_slowfence_{RUN}_{i}" for i in range(10)]
    later = [f"wfx_slowfence_{RUN}_later_{i}" for i in range(10)]
    first = PodProcess(env, tmp_path / "pod-1.log")
    first.start()
    await first.wait_for_log("state restored")
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in pending))
    states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=10, timeout_s=30))
    assert all(len(states[e].pending) == 1 for e in pending)
    first.kill9()
    await produce(kafka_bootstrap, env, *(wf_created(e) for e in later))

    from aiokafka import AIOKafkaConsumer

    from consumers.runtime.kafka.sink import PartitionSinks

    open_sinks = PartitionSinks.open
    # The pod's fetches: how many returned, and the partition numbers each handed records of.
    fetches: list[set[int]] = []
    getmany = AIOKafkaConsumer.getmany

    async def counted_getmany(self: AIOKafkaConsumer, *args: Any, **kwargs: Any) -> Any:
        fetched = await getmany(self, *args, **kwargs)
        fetches.append({tp.partition for tp, records in fetched.items() if records})
        return fetched

    async def slow_open(self: PartitionSinks, partitions: Iterable[int]) -> None:
        """The fence held until the pod's loop has fetched three times meanwhile: had the partitions
        not been held back, their records (produced before the pod started) were handed out by now."""
        wanted = set(partitions)
        first = len(fetches)
        deadline = asyncio.get_running_loop().time() + 30
        while len(fetches) < first + 3:
            assert asyncio.get_running_loop().time() < deadline, f"{len(fetches) - first} fetches in 30 s"
            await asyncio.sleep(0.05)
        handed = [f & wanted for f in fetches[first:] if f & wanted]
        assert handed == [], f"records of partitions being taken over were handed out: {handed}"
        await open_sinks(self, partitions)

    monkeypatch.setattr(AIOKafkaConsumer, "getmany", counted_getmany)

    monkeypatch.setattr(PartitionSinks, "open", slow_open)
    # Calls longer than the fence's wait: resumed too early, they would still run when it ends.
    second_env = {
        **env,
        "SANDBOX_LANES_POD_ID": "pod-b",
        "SANDBOX_LANES_DRIVER_OPTIONS": "ensure_latency_ms=5000",
    }
    async with running_pod(second_env):
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=20, timeout_s=60)
        states = latest_states(await read_topic(kafka_bootstrap, topics.state, at_least=40, timeout_s=30))
    assert_one_outcome_each(outcomes, pending + later, outcomes_pb2.SandboxProvisioned)
    assert [e for e in pending + later if states[e].pending] == []
