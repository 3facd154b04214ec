"""Read back what the pod wrote (outcomes ``read_committed``, dead letters, state) and check the invariants."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from consumers.runtime.kafka.topology import Topics
from events.codec import OUTCOME_TYPES, decode, decode_state, header
from events.sandbox_lanes.v1 import outcomes_pb2, state_pb2
from tests.support.chaos_workload import DriverResult, Expected, Op, Workload, expected_from_plan

PROVISION_TYPES = (outcomes_pb2.SandboxProvisioned, outcomes_pb2.SandboxFailed)
TEARDOWN_TYPES = (outcomes_pb2.SandboxDeprovisioned, outcomes_pb2.SandboxTeardownFailed)


@dataclass
class RawRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    # topics() fetches metadata without updating the client's cluster view; ask the client directly.
    await consumer._client._wait_on_metadata(topic)
    return set(consumer.partitions_for_topic(topic) or ())


async def read_all(
    bootstrap: str, topic: str, *, isolation_level: str = "read_committed", timeout_s: float = 120.0
) -> list[RawRecord]:
    """Every record of ``topic`` from the beginning up to its end offsets (the LSO under read_committed)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level=isolation_level,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    out: list[RawRecord] = []
    try:
        partitions = await _partitions(consumer, topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return out
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        pending = {tp for tp in tps if end[tp] > 0}
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} did not reach its end in {timeout_s:g}s")
            batch = await consumer.getmany(*pending, timeout_ms=500, max_records=20_000)
            for tp, recs in batch.items():
                for rec in recs:
                    headers = {k: (v or b"").decode("utf-8", errors="replace") for k, v in rec.headers or ()}
                    out.append(RawRecord(tp.partition, rec.offset, rec.key, rec.value, headers))
            for tp in list(pending):
                if await consumer.position(tp) >= end[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    return out


async def group_lag(bootstrap: str, group_id: str, topics: list[str]) -> int:
    """How many input records the group has not committed yet (end offsets minus committed)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False
    )  # no group
    await admin.start()
    await consumer.start()
    try:
        tps = []
        for topic in topics:
            for p in await _partitions(consumer, topic):
                tps.append(TopicPartition(topic, p))
        end = await consumer.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group_id, partitions=tps)
        lag = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else 0
            lag += max(0, end[tp] - done)
        return lag
    finally:
        await consumer.stop()
        await admin.close()


async def wait_caught_up(
    bootstrap: str, group_id: str, topics: list[str], timeout_s: float, on_tick: object = None
) -> int:
    deadline = time.monotonic() + timeout_s
    lag = -1
    while time.monotonic() < deadline:
        try:
            lag = await group_lag(bootstrap, group_id, topics)
        except Exception:  # broker briefly unreachable: ask again
            lag = -1
        if lag == 0:
            return 0
        if callable(on_tick):
            on_tick()
        await asyncio.sleep(1.0)
    return lag


async def wait_effects_folded(
    bootstrap: str, state_topic: str, timeout_s: float, on_tick: object = None
) -> int:
    """Wait until no execution state holds a pending driver call (its result folded back).

    Offsets are committed when a record is decided; its driver call completes in a later
    transaction, so "the group caught up" alone does not mean every outcome is written.
    Returns the number of states still pending (0 = done).
    """
    deadline = time.monotonic() + timeout_s
    pending = -1
    while time.monotonic() < deadline:
        latest: dict[bytes, bytes | None] = {}
        try:
            for rec in await read_all(bootstrap, state_topic):
                latest[rec.key or b""] = rec.value
        except Exception:  # broker briefly unreachable: ask again
            await asyncio.sleep(1.0)
            continue
        pending = sum(1 for v in latest.values() if v is not None and decode_state(v).pending)
        if pending == 0:
            return 0
        if callable(on_tick):
            on_tick()
        await asyncio.sleep(1.0)
    return pending


@dataclass
class Outcome:
    ce_id: str
    causation: str
    message: (
        outcomes_pb2.SandboxProvisioned
        | outcomes_pb2.SandboxFailed
        | outcomes_pb2.SandboxDeprovisioned
        | outcomes_pb2.SandboxTeardownFailed
    )


@dataclass
class Verdict:
    lines: list[tuple[str, bool, str]] = field(default_factory=list)
    figures: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def check(self, name: str, problems: list[str], detail: str = "") -> None:
        self.lines.append((name, not problems, detail))
        self.violations.extend(f"{name}: {p}" for p in problems)

    @property
    def ok(self) -> bool:
        return not self.violations


def _sample(items: list[str], n: int = 8) -> list[str]:
    return items if len(items) <= n else [*items[:n], f"... and {len(items) - n} more"]


def observed_results(outcomes: list[Outcome]) -> tuple[dict[tuple[str, Op], DriverResult], set[str]]:
    """What the driver returned for each call, by (deciding input id, op), as its outcome says; and
    the keys whose calls came out differently in two runs (at_least_once re-runs), unpredictable."""
    seen: dict[tuple[str, Op], set[DriverResult]] = defaultdict(set)
    key_of: dict[tuple[str, Op], str] = {}
    for o in outcomes:
        m = o.message
        op: Op = "Ensure" if isinstance(m, PROVISION_TYPES) else "Deprovision"
        ok = isinstance(m, outcomes_pb2.SandboxProvisioned | outcomes_pb2.SandboxDeprovisioned)
        seen[(o.causation, op)].add((ok, "" if ok else m.reason))  # type: ignore[union-attr]
        key_of[(o.causation, op)] = m.execution_id or m.sandbox.sandbox_id
    results = {call: next(iter(r)) for call, r in seen.items() if len(r) == 1}
    ambiguous = {key_of[call] for call, r in seen.items() if len(r) > 1}
    return results, ambiguous


def _unstamped(state: state_pb2.ExecutionState) -> state_pb2.ExecutionState:
    """The state without the fingerprint of the configuration it was made under (the oracle derives
    what the rules decide, not which configuration a pod ran: that is checked apart)."""
    copy = state_pb2.ExecutionState()
    copy.CopyFrom(state)
    copy.ClearField("config_fingerprint")
    return copy


def state_diff(want: state_pb2.ExecutionState, got: state_pb2.ExecutionState) -> list[str]:
    names = {f.name for f, _ in want.ListFields()} | {f.name for f, _ in got.ListFields()}
    return sorted(
        f"{n} {str(getattr(got, n)).strip()!r}, expected {str(getattr(want, n)).strip()!r}"
        for n in names
        if getattr(want, n) != getattr(got, n)
    )


async def verify(
    bootstrap: str,
    topics: Topics,
    workload: Workload,
    *,
    guarantee: str,
    all_event_ids: set[str],
    driver: str,
) -> tuple[Verdict, dict[str, state_pb2.ExecutionState], Expected]:
    """Check what the pods wrote against the oracle (``expected_from_plan``), which is given only the
    plan and each driver call's result as its outcome reports it (never the pod's states or messages)."""
    verdict = Verdict()
    out_raw, dlq_raw, state_raw = await asyncio.gather(
        read_all(bootstrap, topics.outcomes),
        read_all(bootstrap, topics.dead_letter),
        read_all(bootstrap, topics.state),
    )
    undecodable: list[str] = []
    outcomes: list[Outcome] = []
    for rec in out_raw:
        try:
            msg = decode(
                rec.key,
                rec.value,
                list((k, v.encode()) for k, v in rec.headers.items()),
                allowed=OUTCOME_TYPES,
            )
        except Exception as exc:
            undecodable.append(f"p{rec.partition}@{rec.offset}: {exc}")
            continue
        if not isinstance(msg, PROVISION_TYPES + TEARDOWN_TYPES):
            continue  # e.g. SandboxReaped: not the lanes' outcome
        outcomes.append(Outcome(rec.headers.get("ce_id", ""), msg.meta.causation_id, msg))
    results, ambiguous = observed_results(outcomes)
    expected = expected_from_plan(workload, lambda event_id, op: results.get((event_id, op)), driver)
    verdict.figures["executions with re-run driver calls that came out differently"] = len(ambiguous)
    ids = Counter(o.ce_id for o in outcomes)
    repeated = {i: n for i, n in ids.items() if n > 1}
    verdict.figures["outcome records"] = len(outcomes)
    verdict.check("outcomes decode", undecodable)

    # 1. exactly one provision outcome per create the rules say to provision.
    by_cause: dict[str, dict[str, Outcome]] = defaultdict(dict)  # causation → ce_id → outcome
    for o in outcomes:
        by_cause[o.causation][o.ce_id] = o
    problems: list[str] = []
    different_result = 0
    for cause, execution in sorted(expected.provision.items()):
        got = [o for o in by_cause.get(cause, {}).values() if isinstance(o.message, PROVISION_TYPES)]
        copies = sum(ids[o.ce_id] for o in got)
        if not got:
            problems.append(f"{execution}: no SandboxProvisioned/SandboxFailed (create {cause})")
        elif len(got) > 1 and guarantee == "at_least_once":
            different_result += 1  # a re-run batch whose driver call came out differently
        elif len(got) > 1 or (guarantee == "exactly_once" and copies > 1):
            problems.append(f"{execution}: {copies} provision outcomes for create {cause}")
    unexpected = [
        f"{type(o.message).__name__} {o.message.execution_id} (cause {o.causation})"
        for o in outcomes
        if isinstance(o.message, PROVISION_TYPES) and o.causation not in expected.provision
    ]
    problems += unexpected
    verdict.check(
        "provision: exactly one SandboxProvisioned|SandboxFailed per provisioning execution",
        _sample(problems),
        f"{len(expected.provision)} expected",
    )
    if guarantee == "at_least_once":
        verdict.figures["at_least_once re-runs with a different driver result"] = different_result

    # 2. no duplicate outcome ids.
    dup_records = sum(n - 1 for n in repeated.values())
    if guarantee == "exactly_once":
        verdict.check(
            "no duplicate outcome ids (exactly_once: none at all)",
            _sample([f"{i} x{n}" for i, n in repeated.items()]),
        )
    else:
        by_id: dict[str, set[bytes]] = defaultdict(set)
        for o in outcomes:
            by_id[o.ce_id].add(o.message.SerializeToString(deterministic=True))
        verdict.check(
            "outcome ids are deterministic (at_least_once: duplicates only as same-id redeliveries)",
            _sample(
                [f"{i}: {len(v)} different records under one id" for i, v in by_id.items() if len(v) > 1]
            ),
        )
        verdict.figures["same-id redeliveries"] = dup_records

    # 3. exactly one teardown outcome per terminal workflow transition and per session deletion.
    # A workflow whose create was refused has no sandbox: upstream tears nothing down at its terminal
    # phase, the pod does (harmlessly) when that phase was decided while the ensure was still out.
    verdict.figures["refused workflow creates"] = sum(1 for st in expected.states.values() if st.refused)
    verdict.figures["teardowns of refused creates (optional)"] = len(expected.teardown_optional)
    problems = []
    for cause, key in sorted(expected.teardown.items()):
        got = [o for o in by_cause.get(cause, {}).values() if isinstance(o.message, TEARDOWN_TYPES)]
        copies = sum(ids[o.ce_id] for o in got)
        if not got:
            problems.append(f"{key}: no SandboxDeprovisioned/SandboxTeardownFailed (input {cause})")
        elif len(got) > 1 and guarantee == "exactly_once":
            problems.append(f"{key}: {len(got)} teardown outcomes for input {cause}")
        elif guarantee == "exactly_once" and copies > 1:
            problems.append(f"{key}: {copies} copies of the teardown outcome of {cause}")
    problems += [
        f"{type(o.message).__name__} for {o.message.sandbox.sandbox_id} (cause {o.causation})"
        for o in outcomes
        if isinstance(o.message, TEARDOWN_TYPES)
        and o.causation not in expected.teardown
        and o.causation not in expected.teardown_optional
    ]
    verdict.check(
        "teardown: exactly one SandboxDeprovisioned|SandboxTeardownFailed per terminal transition / deletion",
        _sample(problems),
        f"{len(expected.teardown)} expected",
    )

    # 4. dead letters: exactly the inputs the rules reject, each with its reason; no valid input.
    seen_dlq: dict[str, int] = Counter()
    problems = []
    foreign = 0
    for rec in dlq_raw:
        event_id = rec.headers.get("ce_id", "")
        if not rec.headers.get("dlq_reason"):
            problems.append(f"dead letter p{rec.partition}@{rec.offset} without dlq_reason")
        if event_id not in all_event_ids:
            foreign += 1
            continue
        source = (
            rec.headers.get("dlq_source_topic"),
            rec.headers.get("dlq_source_partition"),
            rec.headers.get("dlq_source_offset"),
        )
        seen_dlq[f"{event_id}|{source}"] += 1
        if event_id not in expected.dead_letters:
            problems.append(f"valid input {event_id} dead-lettered: {rec.headers.get('dlq_reason')}")
    dead_ids = {k.split("|", 1)[0] for k in seen_dlq}
    problems += [f"{e} not dead-lettered" for e in sorted(expected.dead_letters - dead_ids)]
    if guarantee == "exactly_once":
        problems += [f"{k} dead-lettered {n} times" for k, n in seen_dlq.items() if n > 1]
    verdict.figures["dead letters"] = len(dlq_raw)
    verdict.check(
        "dead letters: exactly the rejected inputs, each with dlq_reason",
        _sample(problems),
        f"{len(expected.dead_letters)} expected",
    )

    # 5. state: every key ends in the whole state the oracle derives (status_error, phase, sandboxes,
    # applied ids, clocks, refusals), every driver call folded back.
    states: dict[str, state_pb2.ExecutionState] = {}
    for rec in state_raw:
        if rec.key is None:
            continue
        if rec.value is None:
            states.pop(rec.key.decode(), None)
        else:
            states[rec.key.decode()] = decode_state(rec.value)
    problems = []
    for key, want in sorted(expected.states.items()):
        if key in ambiguous:
            continue
        state = states.get(key)
        if state is None:
            problems.append(f"{key}: no state record")
        elif not state.config_fingerprint:
            problems.append(f"{key}: no configuration fingerprint (issue 35: every state carries one)")
        elif _unstamped(state) != want:
            problems.append(f"{key}: " + "; ".join(state_diff(want, _unstamped(state))))
    verdict.check(
        "state: every execution ends in the state the spec derives (status_error first-non-empty, phase, sandboxes)",
        _sample(problems),
        f"{len(expected.states) - len(ambiguous & set(expected.states))} keys",
    )

    # 6. per state: no terminal workflow still records a live sandbox.
    problems = []
    left_for_reaper = 0
    for key in sorted(expected.terminal_workflows & expected.provisioning_workflows):
        state = states.get(key)
        lifecycles = [s.lifecycle for s in state.sandboxes] if state is not None else []
        if state_pb2.SANDBOX_PROVISIONED in lifecycles or not lifecycles:
            problems.append(f"{key}: terminal but its state says {lifecycles}")
        if state_pb2.SANDBOX_TEARDOWN_FAILED in lifecycles:
            left_for_reaper += 1
    verdict.figures["teardowns failed (left for the reaper)"] = left_for_reaper
    verdict.check("state: no terminal workflow records a live sandbox", _sample(problems))
    verdict.figures["injected ensure failures seen"] = sum(
        1 for o in outcomes if isinstance(o.message, outcomes_pb2.SandboxFailed)
    )
    verdict.figures["injected teardown failures seen"] = sum(
        1 for o in outcomes if isinstance(o.message, outcomes_pb2.SandboxTeardownFailed)
    )
    return verdict, states, expected


def header_of(rec: RawRecord, name: str) -> str | None:
    return header([(k, v.encode()) for k, v in rec.headers.items()], name)
