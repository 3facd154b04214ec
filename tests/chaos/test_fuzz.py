"""Bad input at volume, on the real broker: a seeded fuzzed stream mixed into valid traffic.

Truncated and garbage protobuf, payloads of the wrong type, payloads over the limit, missing and
wrong keys, missing or unknown ``ce_type``, unknown enum values, missing event ids, tombstones,
phase changes for executions that never exist and phase changes before their execution's create.
Every bad record must land in the dead-letter topic exactly once with its reason, every valid
execution must get its outcomes, and the pod (a ``sandbox-lanes run`` child process) never stops.

The expectations do not come from the decoder under test: every record is generated bad in one
known way, by construction, and its expected reason is the one the event contract gives that
defect (``docs/guarantees.md#bad-input`` and the ``.proto`` files). Garbage starts with a tag of a
wire type protobuf does not have (6 or 7); a truncation cuts a valid encoding anywhere but between
two of its top-level fields (found by walking the wire format here, by hand), so a field is left
incomplete; a payload of another type, or an ``execution_id`` sent as a varint, leaves the
created event without an ``execution_id`` whether the parser refuses the mismatched wire types or
keeps them as unknown fields. No generated record is dropped for "happening to decode".
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
from events.codec import MAX_PAYLOAD_BYTES, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.barrier import barrier
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import PodProcess, unique_env

pytestmark = pytest.mark.kafka

SEED = 20250105
VALID_EXECUTIONS = 500
BAD_RECORDS = 1200
HUGE = 3
#: Phase changes produced before their execution's create. The create-order gate holds each one until
#: the execution-created partition is seen caught up on fetches 1 s + 3 s apart (about 4 s), one at a
#: time per partition: 6 over the 2 partitions (3 and 3 here, ~12 s) show a row of them handled in turn; the
#: 40 there were before cost ~80 s for nothing more.
EARLY = 6


#: The reason a dead letter gives for a payload that is not valid protobuf of its ``ce_type``.
UNDECODABLE = "payload does not decode as sandbox_lanes.v1.ExecutionCreated"
#: What each kind of bad record is dead-lettered for: its ``dlq_reason`` contains one of these.
REASONS: dict[str, tuple[str, ...]] = {
    "garbage": (UNDECODABLE,),
    "truncated": (UNDECODABLE,),
    "wrong-type": (UNDECODABLE, "missing execution_id"),
    "wrong-wire-type": (UNDECODABLE, "missing execution_id"),
    "missing-key": ("missing record key",),
    "wrong-key": ("does not match",),
    "unknown-enum": ("unknown enum value 42 for field workflow_execution_target",),
    "unknown-kind": ("unknown enum value 99 for field kind",),
    "missing-kind": ("missing kind",),
    "missing-event-id": ("missing meta.event_id",),
    # A topic says the type (issue 43): a record without ce_type is read as its topic's type, so only
    # one that also lacks its event id is refused.
    "missing-ce-type": ("missing meta.event_id",),
    "unknown-ce-type": ("unknown event type 'sandbox_lanes.v1.Nonsense'",),
    "tombstone": ("empty payload (tombstone)",),
    "future-schema": ("unsupported schema_version 9",),
    "unknown-execution": ("phase-changed for unknown execution",),
    "huge": ("exceeds the",),
    "early": ("phase-changed for unknown execution",),
}


@dataclass
class Rec:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    kind: str = "valid"
    """``valid``, or the one way this record was made bad (a key of :data:`REASONS`)."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """Substrings one of which the dead letter's ``dlq_reason`` must contain; () = valid."""
        return REASONS.get(self.kind, ())


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


def _top_level_boundaries(value: bytes) -> set[int]:
    """Offsets at which a top-level field of a valid encoding ends (and 0): the protobuf wire
    format walked by hand (tag varint, then a varint, 8 bytes, a length-prefixed run or 4 bytes)."""

    def varint(i: int) -> tuple[int, int]:
        number, shift = 0, 0
        while True:
            byte = value[i]
            i += 1
            number |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return number, i

    bounds, i = {0}, 0
    while i < len(value):
        tag, i = varint(i)
        wire_type = tag & 7
        if wire_type == 0:
            _, i = varint(i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 2:
            length, i = varint(i)
            i += length
        elif wire_type == 5:
            i += 4
        else:
            raise AssertionError(f"wire type {wire_type} in a valid encoding")
        bounds.add(i)
    assert i == len(value)
    return bounds


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
        assert good.value is not None
        if kind == "garbage":  # a first tag of wire type 6 or 7 (none such exists), then noise
            tag = (rng.randint(1, 15) << 3) | rng.choice((6, 7))
            return Rec(
                good.topic, good.key, bytes([tag]) + rng.randbytes(rng.randint(0, 300)), good.headers, kind
            )
        if kind == "truncated":  # cut inside a field: never at one of the encoding's field ends
            bounds = _top_level_boundaries(good.value)
            cut = rng.choice([k for k in range(1, len(good.value)) if k not in bounds])
            return Rec(good.topic, good.key, good.value[:cut], good.headers, kind)
        if kind == "wrong-type":  # a PhaseChanged payload announced as an ExecutionCreated
            # PhaseChanged's fields 2-5 (execution_id, kind, phases) have other wire types than
            # ExecutionCreated's 2-5 (kind, execution_id, name, org): read as a create, it has
            # no execution_id either way the mismatches are taken.
            phase = rec(_phase(eid, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_FAILED))
            return Rec(good.topic, good.key, phase.value, good.headers, kind)
        if kind == "wrong-wire-type":  # its only execution_id (field 3, a string) sent as a varint
            bare = _created(eid, name="x")
            bare.ClearField("execution_id")
            return Rec(good.topic, good.key, bare.SerializeToString() + b"\x18\x07", good.headers, kind)
        if kind == "missing-key":
            return Rec(good.topic, None, good.value, good.headers, kind)
        if kind == "wrong-key":
            return Rec(good.topic, f"someone_else_{n}".encode(), good.value, good.headers, kind)
        if kind == "unknown-enum":
            created = _created(eid)
            created.workflow_execution_target = 42  # type: ignore[assignment]
            made = rec(created)
        elif kind == "unknown-kind":
            created = _created(eid)
            created.kind = 99  # type: ignore[assignment]
            made = rec(created)
        elif kind == "missing-kind":
            created = _created(eid)
            created.kind = common_pb2.EXECUTION_KIND_UNSPECIFIED
            made = rec(created)
        elif kind == "missing-event-id":
            created = _created(eid)
            created.meta.event_id = ""
            made = rec(created)
        elif kind == "missing-ce-type":
            created = _created(eid)
            created.meta.event_id = ""
            made = with_header(rec(created), "ce_type", None)
        elif kind == "unknown-ce-type":
            made = with_header(good, "ce_type", b"sandbox_lanes.v1.Nonsense")
        elif kind == "tombstone":
            made = Rec(good.topic, good.key, None, good.headers)
        elif kind == "future-schema":
            created = _created(eid)
            created.meta.schema_version = 9
            made = rec(created)
        elif kind == "unknown-execution":
            made = rec(_phase(eid, common_pb2.EXECUTION_IN_PROGRESS, common_pb2.EXECUTION_COMPLETED))
        else:
            raise AssertionError(kind)
        made.kind = kind
        return made

    kinds = [k for k in REASONS if k not in ("huge", "early")]
    bad: list[Rec] = []
    n = 0
    while len(bad) < BAD_RECORDS - HUGE:
        n += 1
        bad.append(mutate(rng.choice(kinds), n))
    for h in range(HUGE):
        eid = f"wfx_huge_{run}_{h}"
        r = rec(_created(eid, name="h" * (MAX_PAYLOAD_BYTES + 10 + h)))
        r.kind = "huge"
        bad.append(r)
    # Phase changes before their create: produced (and dead-lettered) first; the creates come after.
    early = []
    late_creates = []
    for e in range(EARLY):
        eid = f"wfx_early_{run}_{e}"
        r = rec(_phase(eid, common_pb2.EXECUTION_PENDING, common_pb2.EXECUTION_IN_PROGRESS))
        r.kind = "early"
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
    bad = [r for r in [*early, *mixed] if r.kind != "valid"]
    # Every kind of bad record is in the stream (none left out by chance or dropped by the generator).
    assert set(Counter(r.kind for r in bad)) == set(REASONS), Counter(r.kind for r in bad)
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
        assert got is not None, f"bad record {fuzz_id} ({want.kind}) not dead-lettered"
        reason = got.headers.get("dlq_reason", "")
        if not any(w in reason for w in want.reasons) or not got.headers.get("dlq_source_topic"):
            mismatched.append((fuzz_id, want.kind, reason))
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
