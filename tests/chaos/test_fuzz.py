"""Bad input at volume, on the real broker: a seeded fuzzed stream mixed into valid traffic.

Truncated and garbage protobuf, payloads of the wrong type, payloads over the limit, missing and
wrong keys, missing or unknown ``ce_type``, unknown enum values, missing event ids, tombstones,
phase changes for executions that never exist and phase changes before their execution's create.
Every bad record must land in the dead-letter topic exactly once with its reason, every valid
execution must get its outcomes, and the pod (a ``sandbox-lanes run`` child process) never stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from consumers.ops.settings import load_settings
from events.codec import MAX_PAYLOAD_BYTES, DecodeError, decode_input, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.barrier import barrier
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import PodProcess, unique_env

pytestmark = pytest.mark.kafka

SEED = 20250105
VALID_EXECUTIONS = 500
BAD_RECORDS = 1200
HUGE = 3


@dataclass
class Rec:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    reason: str | None = None
    """None = valid; else a substring the dead letter's ``dlq_reason`` must contain."""


def _created(execution_id: str, **fields: object) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
        **fields,  # type: ignore[arg-type]
    )


def _phase(execution_id: str, previous: int, new: int) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=previous,  # type: ignore[arg-type]
        new_phase=new,  # type: ignore[arg-type]
    )


def _codec_reason(rec: Rec) -> str | None:
    try:
        decode_input(rec.key, rec.value, rec.headers)
    except DecodeError as exc:
        return exc.reason
    return None


def build_stream(env: dict[str, str], run: str) -> tuple[list[Rec], list[Rec], list[Rec], set[str]]:
    """(records before the creates, the mixed stream, creates for the early phase changes, valid ids)."""
    rng = random.Random(SEED)
    topics = load_settings(env).topics

    def rec(
        message: inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted,
    ) -> Rec:
        encoded = encode(message, source="fuzz")
        topic = {
            "ExecutionCreated": topics.execution_created,
            "PhaseChanged": topics.phase_changed,
            "SessionDeleted": topics.session_deleted,
        }[type(message).__name__]
        return Rec(topic, encoded.key, encoded.value, list(encoded.headers))

    valid: list[Rec] = []
    valid_ids: set[str] = set()
    for i in range(VALID_EXECUTIONS):
        eid = f"wfx_fz_{run}_{i}"
        valid_ids.add(eid)
        valid += [
            rec(_created(eid)),
            rec(_phase(eid, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS)),
            rec(_phase(eid, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED)),
        ]

    def with_header(r: Rec, name: str, value: bytes | None) -> Rec:
        headers = [h for h in r.headers if h[0] != name]
        if value is not None:
            headers.append((name, value))
        return Rec(r.topic, r.key, r.value, headers)

    def mutate(kind: str, n: int) -> Rec:
        eid = f"wfx_bad_{run}_{n}"
        good = rec(_created(eid, name="x" * rng.randint(0, 40)))
        if kind == "garbage":
            return Rec(good.topic, good.key, rng.randbytes(rng.randint(1, 300)), good.headers)
        if kind == "truncated":
            assert good.value is not None
            return Rec(good.topic, good.key, good.value[: rng.randint(1, len(good.value) - 1)], good.headers)
        if kind == "wrong-type":  # a PhaseChanged payload announced as another type, or the reverse
            phase = rec(_phase(eid, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_FAILED))
            phase.value = (phase.value or b"") + b"\x1a\x05hello"  # field 3 as a string, not an enum
            return Rec(good.topic, good.key, phase.value, good.headers)
        if kind == "wrong-wire-type":  # execution_id (field 3, a string) sent as a varint
            return Rec(good.topic, good.key, (good.value or b"") + b"\x18\x07", good.headers)
        if kind == "missing-key":
            return Rec(good.topic, None, good.value, good.headers)
        if kind == "wrong-key":
            return Rec(good.topic, f"someone_else_{n}".encode(), good.value, good.headers)
        if kind == "unknown-enum":
            created = _created(eid)
            created.workflow_execution_target = 42  # type: ignore[assignment]
            return rec(created)
        if kind == "unknown-kind":
            created = _created(eid)
            created.kind = 99  # type: ignore[assignment]
            return rec(created)
        if kind == "missing-kind":
            created = _created(eid)
            created.kind = common_pb2.EXECUTION_KIND_UNSPECIFIED
            return rec(created)
        if kind == "missing-event-id":
            created = _created(eid)
            created.meta.event_id = ""
            return rec(created)
        if kind == "missing-ce-type":
            return with_header(good, "ce_type", None)
        if kind == "unknown-ce-type":
            return with_header(good, "ce_type", b"sandbox_lanes.v1.Nonsense")
        if kind == "tombstone":
            return Rec(good.topic, good.key, None, good.headers)
        if kind == "future-schema":
            created = _created(eid)
            created.meta.schema_version = 9
            return rec(created)
        if kind == "unknown-execution":
            r = rec(_phase(eid, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED))
            r.reason = "phase-changed for unknown execution"
            return r
        raise AssertionError(kind)

    kinds = [
        "garbage", "truncated", "wrong-type", "wrong-wire-type", "missing-key", "wrong-key", "unknown-enum",
        "unknown-kind", "missing-kind", "missing-event-id", "missing-ce-type", "unknown-ce-type",
        "tombstone", "future-schema", "unknown-execution",
    ]  # fmt: skip
    bad: list[Rec] = []
    n = 0
    while len(bad) < BAD_RECORDS - HUGE:
        n += 1
        r = mutate(rng.choice(kinds), n)
        if r.reason is None:
            r.reason = _codec_reason(r)
            if r.reason is None:  # a random mutation that happens to decode: not a bad record
                continue
        bad.append(r)
    for h in range(HUGE):
        eid = f"wfx_huge_{run}_{h}"
        r = rec(_created(eid, name="h" * (MAX_PAYLOAD_BYTES + 10 + h)))
        r.reason = "exceeds the"
        bad.append(r)
    # Phase changes before their create: produced (and dead-lettered) first; the creates come after.
    early = []
    late_creates = []
    for e in range(40):
        eid = f"wfx_early_{run}_{e}"
        r = rec(_phase(eid, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS))
        r.reason = "phase-changed for unknown execution"
        early.append(r)
        late_creates.append(rec(_created(eid)))
        valid_ids.add(eid)
    for i, r in enumerate([*bad, *early]):
        r.headers = [*r.headers, ("fuzz_id", str(i).encode())]
    # Mix the bad records into the valid traffic, keeping each valid execution's own order.
    mixed: list[Rec] = list(valid)
    for r in bad:
        mixed.insert(rng.randint(0, len(mixed)), r)
    return early, mixed, late_creates, valid_ids


async def _produce(bootstrap: str, records: list[Rec]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4 * MAX_PAYLOAD_BYTES
    )
    await producer.start()
    try:
        futures = [await producer.send(r.topic, r.value, key=r.key, headers=r.headers) for r in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _allow_large_records(bootstrap: str, topics: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, t, {"max.message.bytes": str(4 * MAX_PAYLOAD_BYTES)})
                for t in topics
            ]
        )
    finally:
        await admin.close()


async def _wait_for(bootstrap: str, topic: str, count: int, pod: PodProcess, timeout_s: float) -> list:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    records = []
    while time.monotonic() < deadline:
        records = await read_all(bootstrap, topic)
        if len(records) >= count:
            return records
        assert pod.proc is not None and pod.proc.poll() is None, f"pod stopped:\n{pod.log()[-3000:]}"
        await asyncio.sleep(1.0)
    return records


@pytest.mark.timeout(300)
async def test_a_fuzzed_stream_dead_letters_every_bad_record_and_processes_every_valid_one(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_HTTP_PORT="0"
    )
    topics = load_settings(env).topics
    run = tmp_path.name[-12:].replace("-", "_")
    early, mixed, late_creates, valid_ids = build_stream(env, run)
    bad = [r for r in [*early, *mixed] if r.reason is not None]
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("pod started", 90)
        await _allow_large_records(kafka_bootstrap, [topics.execution_created, topics.dead_letter])
        await _produce(kafka_bootstrap, early)
        await _wait_for(kafka_bootstrap, topics.dead_letter, len(early), pod, 90)
        await _produce(kafka_bootstrap, mixed)
        await _produce(kafka_bootstrap, late_creates)
        expected_outcomes = 2 * VALID_EXECUTIONS + len(late_creates)
        outcomes = await _wait_for(kafka_bootstrap, topics.outcomes, expected_outcomes, pod, 180)
        dead = await _wait_for(kafka_bootstrap, topics.dead_letter, len(bad), pod, 60)
        # Sentinels behind every record: once the pod applied them and folded every driver call,
        # anything extra would be in the topics now.
        await barrier(kafka_bootstrap, env, timeout_s=120)
        dead = await read_all(kafka_bootstrap, topics.dead_letter)
        outcomes = await read_all(kafka_bootstrap, topics.outcomes)
        assert pod.proc is not None and pod.proc.poll() is None, "the pod stopped"
    finally:
        code, _ = pod.terminate()
    assert code == 0, pod.log()[-3000:]

    # Every bad record exactly once in the DLQ, with its reason and where it came from.
    assert len(dead) == len(bad), (len(dead), len(bad))
    by_fuzz_id = {r.headers["fuzz_id"]: r for r in dead}
    assert len(by_fuzz_id) == len(bad)
    mismatched = []
    wanted = {dict(r.headers)["fuzz_id"].decode(): r for r in bad}
    for fuzz_id, want in wanted.items():
        got = by_fuzz_id.get(fuzz_id)
        assert got is not None, f"bad record {fuzz_id} ({want.reason}) not dead-lettered"
        reason = got.headers.get("dlq_reason", "")
        if want.reason not in reason or not got.headers.get("dlq_source_topic"):
            mismatched.append((fuzz_id, want.reason, reason))
        if want.value is not None and len(want.value) <= MAX_PAYLOAD_BYTES:
            assert got.value == want.value, f"dead letter {fuzz_id} lost its original bytes"
        elif want.value is not None:  # over the limit: cut to fit, with the original's size and hash
            assert got.headers.get("dlq_value_size") == str(len(want.value)), got.headers
            assert got.headers.get("dlq_value_sha256") == hashlib.sha256(want.value).hexdigest()
            assert got.value is not None and want.value.startswith(got.value) and len(got.value) > 900_000
    assert mismatched == []
    kinds = Counter(r.headers["dlq_reason"].split(":")[0].split("'")[0][:40] for r in dead)
    assert len(kinds) >= 10, kinds

    # Every valid execution got its outcomes: provisioned and, on COMPLETED, deprovisioned.
    from events.codec import OUTCOME_TYPES, decode

    per_execution: dict[str, list[str]] = {}
    for r in outcomes:
        msg = decode(r.key, r.value, [(k, v.encode()) for k, v in r.headers.items()], allowed=OUTCOME_TYPES)
        per_execution.setdefault(getattr(msg, "execution_id"), []).append(type(msg).__name__)  # noqa: B009
    assert set(per_execution) == valid_ids
    for eid in valid_ids:
        got = sorted(per_execution[eid])
        if eid.startswith("wfx_early_"):
            assert got in (["SandboxProvisioned"], ["SandboxFailed"]), (eid, got)
        else:
            assert got in (
                ["SandboxDeprovisioned", "SandboxProvisioned"],
                ["SandboxDeprovisioned", "SandboxFailed"],
            ), (eid, got)
