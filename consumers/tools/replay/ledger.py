"""Replay of the capacity ledger: every admission re-derived from the capacity log alone.

The ledger's owner decides over one log with the pure ``lanes.admission``; its answers went to the
executions' partitions of the admissions topic. Here the log is decided again over an empty ledger
and the answers compared with those recorded, partition by partition in order (an execution's
partition reads them in that order), bytes for bytes but ``meta.source`` (the owner's pod name).

The caps in force before the log's first tick are the first tick's: the first owner writes its
tick when it takes the log over, and decides the records already waiting under those same caps;
every later owner restores the last tick with the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiokafka import ConsumerRecord, TopicPartition

from consumers.lanes.admission import Caps, Ledger, decide
from consumers.tools.replay.compare import Divergence, ReplayReport
from events.codec import CapacityAnswer, DecodeError, decode_answer, decode_capacity
from events.sandbox_lanes.v1 import capacity_pb2

Records = Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


def _comparable(message: CapacityAnswer) -> bytes:
    """The answer's bytes without ``meta.source`` (which pod owned the log is not a decision)."""
    source = message.meta.source
    message.meta.ClearField("source")
    try:
        return message.SerializeToString(deterministic=True)
    finally:
        message.meta.source = source


def derive_answers(
    log: Iterable[ConsumerRecord[bytes, bytes]],
) -> tuple[dict[int, list[CapacityAnswer]], int]:
    """The answers the log's records call for, per partition in order; and the records decided."""
    records = []
    for rec in sorted(log, key=lambda r: r.offset):
        try:
            records.append((rec.offset, decode_capacity(rec.key, rec.value, rec.headers)))
        except DecodeError:
            continue  # the owner passed over it too (said in its log)
    first_tick = next((r for _, r in records if isinstance(r, capacity_pb2.CapacityTick)), None)
    ledger = Ledger(Caps.of_tick(first_tick) if first_tick is not None else Caps())
    answers: dict[int, list[CapacityAnswer]] = {}
    for offset, record in records:
        for answer in decide(record, offset, ledger).answers:
            answers.setdefault(answer.partition, []).append(answer.message)
    return answers, len(records)


def compare_ledger(log: Records, recorded: Records, report: ReplayReport) -> None:
    """Decide the capacity log again and compare with the admissions topic, into ``report``."""
    derived, decided = derive_answers(r for recs in log.values() for r in recs)
    report.capacity_records = decided
    report.capacity_answers_derived = sum(len(v) for v in derived.values())
    by_partition: dict[int, list[tuple[ConsumerRecord[bytes, bytes], CapacityAnswer | None]]] = {}
    for tp, recs in recorded.items():
        for rec in sorted(recs, key=lambda r: r.offset):
            try:
                message: CapacityAnswer | None = decode_answer(rec.key, rec.value, rec.headers)
            except DecodeError:
                message = None
            by_partition.setdefault(tp.partition, []).append((rec, message))
    report.capacity_answers_recorded = sum(len(v) for v in by_partition.values())
    for partition in sorted(set(derived) | set(by_partition)):
        mine = derived.get(partition, [])
        theirs = by_partition.get(partition, [])
        for i in range(max(len(mine), len(theirs))):
            want = mine[i] if i < len(mine) else None
            got, message = theirs[i] if i < len(theirs) else (None, None)
            source = {"topic": got.topic, "partition": got.partition, "offset": got.offset} if got else {}
            if want is not None and message is not None and _comparable(want) == _comparable(message):
                report.capacity_answers_matched += 1
                continue
            if want is None:
                kind, detail = "unexpected_capacity_answer", "a recorded answer the log does not call for"
            elif got is None:
                kind, detail = "missing_capacity_answer", "the log calls for an answer not recorded"
            else:
                kind, detail = "capacity_answer_mismatch", "the recorded answer differs from the derived one"
            about = want if want is not None else message
            report.divergences.append(
                Divergence(
                    kind,
                    detail,
                    key=about.execution_id if about is not None else "",
                    type=type(about).__name__ if about is not None else "unreadable",
                    source=source,
                )
            )


__all__ = ["compare_ledger", "derive_answers"]
