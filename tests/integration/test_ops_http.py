"""/metrics, /healthz and /readyz over real HTTP, on a real pod and the real Kafka broker.

* ``sandbox-lanes run`` as a child process (the HTTP server on the pod's own loop, bound to a free
  loopback port): liveness, readiness, every metric family, counters and histograms that move as
  events flow, JSON decision log lines, SIGTERM closing both.
* Readiness follows recovery: a state topic seeded with many records keeps /readyz at 503
  ("restoring state") until the restore is done, then 200.
* A stalled loop (a driver whose ensure outlasts the stall bound) turns /healthz to 503, and it
  recovers when the batch completes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from harness.memory_driver import MemoryProvisioner
from prometheus_client.parser import text_string_to_metric_families

from consumers.ops.compose import compose
from consumers.ops.http_server import OpsServer
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.topology import ensure_topics
from consumers.tools.embedded_broker import free_port
from drivers.contract import SandboxEnvironment, SandboxProbeState, SandboxScope
from events.codec import encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2
from tests.support.pod_harness import (
    ROOT,
    PodProcess,
    create_inputs,
    produce,
    produce_raw,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
)

pytestmark = pytest.mark.usefixtures("no_leftover_pods")  # tests/support/fixtures/pods.py

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# --- helpers (also used by tests/integration/test_packaging.py) -----------------------------------------------


async def http_get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of ``GET http://127.0.0.1:<port><path>``."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{port}{path}") as resp,
    ):
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


async def wait_for_status(port: int, path: str, status: int, timeout_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            code, _, body = await http_get(port, path)
            last = (code, body)
            if code == status:
                parsed: dict[str, object] = json.loads(body)
                return parsed
        except (aiohttp.ClientError, OSError) as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{path} never answered {status}; last: {last}")


def samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(parsed: Samples, name: str, **labels: str) -> float | None:
    return parsed.get((name, frozenset(labels.items())))


def total(parsed: Samples, name: str, **labels: str) -> float:
    """The sum over every series of ``name`` carrying ``labels`` (whatever its other labels)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in parsed.items() if n == name and wanted <= have)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")


def http_env(**overrides: str) -> dict[str, str]:
    return {"SANDBOX_LANES_HTTP_HOST": "127.0.0.1", "SANDBOX_LANES_HTTP_PORT": str(free_port()), **overrides}


def agent_created(execution_id: str, session_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id=execution_id,
        session_id=session_id,
        session_execution_target=common_pb2.CLOUD,
    )


# --- the pod process ----------------------------------------------------------------------------------


@pytest.mark.kafka
async def test_metrics_health_and_readiness_of_a_running_pod(kafka_bootstrap: str, tmp_path: Path) -> None:
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_DRIVER_OPTIONS="teardown_failure_rate=1",  # every teardown fails: "leaked"
        SANDBOX_LANES_REVISION="0123abc",  # what the image's build argument sets
        **http_env(),
    )
    port = int(env["SANDBOX_LANES_HTTP_PORT"])
    topics = load_settings(env).topics
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    health = await wait_for_status(port, "/healthz", 200)
    assert health["alive"] is True
    ready = await wait_for_status(port, "/readyz", 200)
    assert ready == {
        "alive": True,
        "ready": True,
        "restoring": False,
        "assigned_partitions": 6,  # 3 input topics x 2 partitions
        "seconds_since_loop": ready["seconds_since_loop"],
        "detail": "ok",
        "commits_failing_seconds": 0.0,
        "seconds_stalled": ready["seconds_stalled"],
        "waiting_for": "",  # no broker wait in progress on a quiet pod
    }
    assert float(str(ready["seconds_since_loop"])) < 5
    # standing still beyond declared waits is never more than the raw time since a turn
    assert 0.0 <= float(str(ready["seconds_stalled"])) <= float(str(ready["seconds_since_loop"]))

    status, content_type, text = await http_get(port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain; version="), content_type
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "sandbox_lanes_events_consumed",
        "sandbox_lanes_decisions",
        "sandbox_lanes_driver_seconds",
        "sandbox_lanes_consumer_lag",
        "sandbox_lanes_dead_letters",
        "sandbox_lanes_reaped_sandboxes",
        "sandbox_lanes_leaked_sandboxes",
        "sandbox_lanes_state_store_keys",
        "sandbox_lanes_state_restore_seconds",
        "sandbox_lanes_state_restored_keys",
        "sandbox_lanes_ready",
        "sandbox_lanes_assigned_partitions",
        "sandbox_lanes_commits_failing_seconds",
        "sandbox_lanes_build_info",
        "process_cpu_seconds",  # the prometheus_client process collector
        "process_resident_memory_bytes",
        "process_open_fds",
    } <= families
    idle = samples(text)
    assert value(idle, "sandbox_lanes_build_info", version="0.1.0", revision="0123abc") == 1
    assert (value(idle, "sandbox_lanes_ready"), value(idle, "sandbox_lanes_assigned_partitions")) == (1, 6)
    assert value(idle, "sandbox_lanes_commits_failing_seconds") == 0
    # The lag gauge is refreshed on scrape, for every assigned input partition once the consumer
    # knows its high watermark (after its first fetch response, which a loaded machine may delay).
    expected_lag = {(t, p): 0.0 for t in topics.inputs for p in ("0", "1")}

    async def idle_lag_is_zero_everywhere() -> bool:
        scraped = samples((await http_get(port, "/metrics"))[2])
        lag = {
            (dict(labels)["topic"], dict(labels)["partition"]): v
            for (name, labels), v in scraped.items()
            if name == "sandbox_lanes_consumer_lag"
        }
        return lag == expected_lag

    await eventually(idle_lag_is_zero_everywhere)
    assert value(idle, "sandbox_lanes_state_store_keys") == 0

    await produce(
        kafka_bootstrap,
        env,
        wf_created("wfx_http_1"),
        agent_created("axr_http_1", "ses_http_1"),
        inputs_pb2.PhaseChanged(
            meta=new_meta(),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id="wfx_http_1",
            previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
            new_phase=common_pb2.EXECUTION_COMPLETED,
        ),
        inputs_pb2.SessionDeleted(meta=new_meta(), session_id="ses_http_1"),
    )
    await produce_raw(kafka_bootstrap, topics.execution_created, b"garbage", b"wfx_bad", [])
    await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)

    moved: Samples = {}

    async def metrics_moved() -> bool:
        nonlocal moved
        moved = samples((await http_get(port, "/metrics"))[2])
        return total(moved, "sandbox_lanes_dead_letters_total") == 1 and (
            value(moved, "sandbox_lanes_state_store_keys") == 3
        )

    await eventually(metrics_moved)
    # Per input partition: summed here (which partition a key lands on is the partitioner's).
    for event_type, want in (("ExecutionCreated", 2), ("PhaseChanged", 1), ("SessionDeleted", 1)):
        assert total(moved, "sandbox_lanes_events_consumed_total", type=event_type) == want, event_type
    partitions = {
        dict(labels)["partition"] for name, labels in moved if name == "sandbox_lanes_events_consumed_total"
    }
    assert partitions and partitions <= {"0", "1"}, partitions
    expected = {
        ("sandbox_lanes_decisions_total", (("lane", "workflow"), ("outcome", "provisioned"))): 1,
        ("sandbox_lanes_decisions_total", (("lane", "session"), ("outcome", "provisioned"))): 1,
        ("sandbox_lanes_decisions_total", (("lane", "terminal"), ("outcome", "teardown_failed"))): 1,
        ("sandbox_lanes_decisions_total", (("lane", "session_delete"), ("outcome", "teardown_failed"))): 1,
        ("sandbox_lanes_leaked_sandboxes_total", (("driver", "memory"),)): 2,
        (
            "sandbox_lanes_driver_seconds_count",
            (("driver", "memory"), ("operation", "provisioning"), ("result", "ok")),
        ): 2,
        (
            "sandbox_lanes_driver_seconds_count",
            (("driver", "memory"), ("operation", "teardown"), ("result", "error")),
        ): 2,
        ("sandbox_lanes_outputs_total", (("type", "SandboxProvisioned"),)): 2,
        ("sandbox_lanes_outputs_total", (("type", "SandboxTeardownFailed"),)): 2,
        ("sandbox_lanes_dead_letters_total", (("reason", "undecodable"),)): 1,
        ("sandbox_lanes_state_store_keys", ()): 3,
    }
    for (name, labels), want in expected.items():
        assert value(moved, name, **dict(labels)) == want, (name, labels, value(moved, name, **dict(labels)))
    assert all(v == 0 for (name, _), v in moved.items() if name == "sandbox_lanes_consumer_lag")
    assert (value(moved, "sandbox_lanes_batch_seconds_count") or 0) >= 1

    # One structured decision line per outcome, with execution id, lane, driver and outcome.
    decisions = [
        json.loads(line)
        for line in pod.log().splitlines()
        if line.startswith("{") and '"sandbox decision"' in line
    ]
    assert sorted((d["executionId"], d["lane"], d["driver"], d["outcome"]) for d in decisions) == [
        ("axr_http_1", "session", "memory", "provisioned"),
        ("ses_http_1", "session_delete", "memory", "teardown_failed"),
        ("wfx_http_1", "terminal", "memory", "teardown_failed"),
        ("wfx_http_1", "workflow", "memory", "provisioned"),
    ]

    code, seconds = pod.terminate()
    assert code == 0 and seconds < 30
    with pytest.raises((aiohttp.ClientError, OSError)):
        await http_get(port, "/healthz")  # the server stopped with the pod


@pytest.mark.kafka
async def test_readiness_follows_state_recovery(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Seed the compacted state topic, start the pod: /readyz is 503 "restoring state" until done."""
    seeded = 60_000
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", **http_env())
    port = int(env["SANDBOX_LANES_HTTP_PORT"])
    settings = load_settings(env)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await ensure_topics(admin, settings.topics, settings.partitions, settings.replication)
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=20)
    await producer.start()
    try:
        pending = []
        for i in range(seeded):
            state = state_pb2.ExecutionState(
                schema_version=1,
                execution_id=f"wfx_seed_{i}",
                kind=common_pb2.WORKFLOW_EXECUTION,
                created=True,
                phase=common_pb2.EXECUTION_IN_PROGRESS,
                applied_event_ids=[f"seed-{i}-a", f"seed-{i}-b"],
            )
            record = encode(state)
            pending.append(
                await producer.send(
                    settings.topics.state, record.value, key=record.key, headers=record.headers
                )
            )
        await producer.flush()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()

    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            code, _, body = await http_get(port, "/readyz")
        except (aiohttp.ClientError, OSError):
            await asyncio.sleep(0.02)
            continue
        detail = str(json.loads(body)["detail"])
        if not seen or seen[-1] != (code, detail):
            seen.append((code, detail))
        if code == 200:
            break
        await asyncio.sleep(0.02)
    assert seen and seen[-1] == (200, "ok"), (seen, pod.log()[-3000:])
    assert (503, "restoring state") in seen, seen
    assert all(code == 503 for code, _ in seen[:-1]), seen
    # Before the restore: not running yet or waiting for the assignment; never ready before it ends.
    order = ["not running", "joining the group", "taking partitions over", "restoring state", "ok"]
    assert [order.index(d) for _, d in seen] == sorted(order.index(d) for _, d in seen), seen
    # While restoring the loop stays alive (liveness must not restart a pod that is recovering).
    parsed = samples((await http_get(port, "/metrics"))[2])
    assert value(parsed, "sandbox_lanes_state_store_keys") == seeded
    assert value(parsed, "sandbox_lanes_state_restored_keys_total") == seeded
    assert (value(parsed, "sandbox_lanes_state_restore_seconds") or 0) > 0
    code, _ = pod.terminate()
    assert code == 0


# --- a stalled loop (in-process pod, real HTTP) --------------------------------------------------------


class SlowProvisioner(MemoryProvisioner):
    """The memory driver with an ensure that takes ``delay`` seconds (a hung engine, a slow apply)."""

    delay: float = 3.0

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        await asyncio.sleep(self.delay)
        return await super().ensure(scope, sandbox_id, env)


@pytest.mark.kafka
async def test_a_slow_driver_call_keeps_the_loop_alive_and_ready(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Driver calls run off the loop: a 3 s ensure is not a stall (liveness stays 200 throughout)."""
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory")
    topics = load_settings(env).topics
    driver = SlowProvisioner()
    async with running_pod(env, provisioner=driver) as composed:
        ops = OpsServer(composed.pod, composed.metrics, host="127.0.0.1", port=0, stall_after_s=1.0)
        await ops.start()
        try:
            await wait_for_status(ops.port, "/readyz", 200)
            await produce(kafka_bootstrap, env, wf_created("wfx_slow_1"))
            codes: list[int] = []
            while composed.pod.stats.outputs.total() == 0:
                codes.append((await http_get(ops.port, "/healthz"))[0])
                await asyncio.sleep(0.1)
            assert len(codes) >= 20 and set(codes) == {200}, codes  # polled through the 3 s call
            outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
            assert [type(r.message).__name__ for r in outcomes] == ["SandboxProvisioned"]
            parsed = samples((await http_get(ops.port, "/metrics"))[2])
            seconds = value(
                parsed,
                "sandbox_lanes_driver_seconds_sum",
                driver="memory",
                operation="provisioning",
                result="ok",
            )
            assert seconds is not None and seconds >= driver.delay
        finally:
            await ops.stop()


@pytest.mark.kafka
async def test_a_stalled_loop_fails_liveness_and_readiness_then_recovers(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn that hangs (a commit waiting on an unreachable coordinator) is a stall: 503, then 200."""
    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory")
    topics = load_settings(env).topics
    async with running_pod(env, provisioner=MemoryProvisioner()) as composed:
        pod = composed.pod
        real_turn = pod.turns.turn
        hang = asyncio.Event()

        async def turn(fetched: Any) -> None:
            if fetched and not hang.is_set():
                hang.set()
                await asyncio.sleep(3.0)  # the hung commit; the event loop itself stays free
            await real_turn(fetched)

        monkeypatch.setattr(pod.turns, "turn", turn)
        ops = OpsServer(pod, composed.metrics, host="127.0.0.1", port=0, stall_after_s=1.0)
        await ops.start()
        try:
            await wait_for_status(ops.port, "/readyz", 200)
            await produce(kafka_bootstrap, env, wf_created("wfx_stall_1"))
            stalled = await wait_for_status(ops.port, "/healthz", 503, timeout_s=20)
            assert stalled["alive"] is False and str(stalled["detail"]).startswith("loop stalled for ")
            code, _, body = await http_get(ops.port, "/readyz")
            assert code == 503 and json.loads(body)["ready"] is False
            recovered = await wait_for_status(ops.port, "/healthz", 200, timeout_s=20)
            assert recovered["detail"] == "ok"
            await wait_for_status(ops.port, "/readyz", 200)
            outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
            assert [type(r.message).__name__ for r in outcomes] == ["SandboxProvisioned"]
        finally:
            await ops.stop()


@pytest.mark.kafka
async def test_commits_that_keep_failing_fail_readiness_not_liveness_then_recover(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod whose every commit fails (a broker refusing writes, a missing ACL) turns its loop: it
    stays alive (a restart would only add a state restore, on every pod at once), /readyz says 503
    with the reason and the gauges say how long; once a commit goes through it is ready again and the
    record is decided exactly once. (The failure is injected at the commit call, the transaction is
    real and aborted for real; a real missing ACL is tests/integration/test_kafka_security.py's.)"""
    from aiokafka.errors import KafkaError

    from consumers.runtime.kafka.sink import TransactionalSink

    env = unique_env(kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory")
    topics = load_settings(env).topics
    real_commit = TransactionalSink.commit
    failing = asyncio.Event()
    failing.set()
    attempts = 0

    async def commit(self: TransactionalSink, offsets: Any) -> None:
        nonlocal attempts
        if failing.is_set():
            attempts += 1
            raise KafkaError("injected: the broker refused the commit")
        await real_commit(self, offsets)

    async with running_pod(env, provisioner=MemoryProvisioner()) as composed:
        ops = OpsServer(composed.pod, composed.metrics, host="127.0.0.1", port=0, stall_after_s=1.0)
        await ops.start()
        try:
            await wait_for_status(ops.port, "/readyz", 200)
            monkeypatch.setattr(TransactionalSink, "commit", commit)
            await produce(kafka_bootstrap, env, wf_created("wfx_failing_commits_1"))
            wedged = await wait_for_status(ops.port, "/readyz", 503, timeout_s=20)
            assert str(wedged["detail"]).startswith("commits failing for "), wedged
            assert wedged["alive"] is True
            assert (await http_get(ops.port, "/healthz"))[0] == 200  # liveness: the loop turns
            scraped = samples((await http_get(ops.port, "/metrics"))[2])
            assert value(scraped, "sandbox_lanes_ready") == 0
            assert (value(scraped, "sandbox_lanes_commits_failing_seconds") or 0) >= 1.0
            assert attempts >= 2  # rewound and retried, not given up
            failing.clear()
            recovered = await wait_for_status(ops.port, "/readyz", 200, timeout_s=20)
            assert recovered["detail"] == "ok" and recovered["commits_failing_seconds"] == 0
            outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1, settle_s=1.0)
            assert [type(r.message).__name__ for r in outcomes] == ["SandboxProvisioned"]
        finally:
            await ops.stop()


@pytest.mark.kafka
async def test_a_member_with_no_partitions_is_ready_and_idle(kafka_bootstrap: str, tmp_path: Path) -> None:
    """More replicas than partitions (a rollout's surge, a scale-up): the member the group leaves
    without partitions is ready, so a rollout does not stall on it."""
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1"
    )
    async with running_pod(env, provisioner=MemoryProvisioner()):  # the first member: every partition
        settings = load_settings({**env, "SANDBOX_LANES_POD_ID": "pod-idle"})
        idle = compose(settings, logging.getLogger("sandbox_lanes"), provisioner=MemoryProvisioner())
        task = asyncio.create_task(idle.pod.run())
        ops = OpsServer(idle.pod, idle.metrics, host="127.0.0.1", port=0, stall_after_s=5.0)
        await ops.start()
        try:
            ready = await wait_for_status(ops.port, "/readyz", 200, timeout_s=60)
            assert (ready["detail"], ready["assigned_partitions"]) == ("idle: no partitions assigned", 0)
            scraped = samples((await http_get(ops.port, "/metrics"))[2])
            assert (
                value(scraped, "sandbox_lanes_ready"),
                value(scraped, "sandbox_lanes_assigned_partitions"),
            ) == (
                1,
                0,
            )
        finally:
            await ops.stop()
            idle.pod.request_stop()
            await asyncio.wait_for(task, 40)


@pytest.mark.kafka
async def test_static_membership_gets_the_partitions_back_without_a_rebalance(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """SANDBOX_LANES_STATIC_MEMBERSHIP: the group consumer joins as static member SANDBOX_LANES_POD_ID;
    on the real broker a member restarted within the session timeout gets its partitions back and the
    other member's generation does not move (no rebalance at all)."""
    from consumers.ops.compose import pod_config
    from consumers.runtime.kafka.clients import group_consumer_for

    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_STATIC_MEMBERSHIP="true",
        SANDBOX_LANES_SESSION_TIMEOUT_MS="20000",
    )
    await create_inputs(env)
    settings = load_settings(env)
    topics = settings.topics

    def member(pod_id: str) -> Any:
        consumer = group_consumer_for(replace(pod_config(settings), pod_id=pod_id))
        assert consumer._group_instance_id == pod_id
        return consumer

    async def assigned(consumer: Any) -> frozenset[Any]:
        for _ in range(300):
            await consumer.getmany(timeout_ms=100)
            if consumer.assignment():
                return frozenset(consumer.assignment())
        raise TimeoutError("no assignment")

    first, other = member("pod-0"), member("pod-1")
    for consumer in (first, other):
        await consumer.start()
        consumer.subscribe(list(topics.inputs))
    try:
        # The group is settled once the two hold every input partition between them, disjoint
        # (a member's first assignment may be from before the other joined).
        every = {TopicPartition(t, p) for t in topics.inputs for p in range(settings.partitions)}
        for _ in range(300):
            await first.getmany(timeout_ms=50)
            await other.getmany(timeout_ms=50)
            mine, theirs = set(first.assignment()), set(other.assignment())
            if mine and theirs and not mine & theirs and mine | theirs == every:
                break
        else:
            raise TimeoutError(f"the group did not settle: {first.assignment()} / {other.assignment()}")
        before = frozenset(first.assignment())
        generation = other._coordinator.generation
        await first.stop()  # a static member leaves no LeaveGroup: the group waits for it
        again = member("pod-0")
        await again.start()
        again.subscribe(list(topics.inputs))
        try:
            assert await assigned(again) == before
            for _ in range(20):
                await other.getmany(timeout_ms=100)
            assert other._coordinator.generation == generation  # no rebalance
        finally:
            await again.stop()
    finally:
        await other.stop()


# --- start-up failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(("level", "fmt"), [("info", "human"), ("warning", "json")])
def test_a_taken_port_fails_fast_with_the_variables_named(tmp_path: Path, level: str, fmt: str) -> None:
    """Also: without --log-level, `run` logs at SANDBOX_LANES_LOG_LEVEL in SANDBOX_LANES_LOG_FORMAT."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = unique_env("127.0.0.1:1", tmp_path, SANDBOX_PROVISIONER_TYPE="memory", **http_env())
        env.update(
            SANDBOX_LANES_HTTP_PORT=str(port), SANDBOX_LANES_LOG_LEVEL=level, SANDBOX_LANES_LOG_FORMAT=fmt
        )
        proc = subprocess.run(
            [sys.executable, "-m", "consumers.tools.cli", "run"],
            env={**env, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"SANDBOX_LANES_HTTP_HOST='127.0.0.1' SANDBOX_LANES_HTTP_PORT={port}: cannot listen" in proc.stderr
    assert "Traceback" not in proc.stderr
    composed = [line for line in proc.stderr.splitlines() if "sandbox provisioner composed" in line]
    if level == "info":  # logged, human-readable although stderr is a pipe
        assert len(composed) == 1 and not composed[0].startswith("{") and "INFO" in composed[0], proc.stderr
    else:  # below the level: not logged
        assert composed == [], proc.stderr
