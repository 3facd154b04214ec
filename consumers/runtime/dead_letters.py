"""The dead-letter record for an input the pod cannot trust: the original, and why, where from, by whom."""

from __future__ import annotations

from aiokafka import ConsumerRecord

from events.codec import MAX_PAYLOAD_BYTES, EncodedRecord


def dead_letter_record(rec: ConsumerRecord[bytes, bytes], reason: str, pod_id: str) -> EncodedRecord:
    headers = [
        *list(rec.headers or ()),
        ("dlq_reason", reason.encode()),
        ("dlq_source_topic", rec.topic.encode()),
        ("dlq_source_partition", str(rec.partition).encode()),
        ("dlq_source_offset", str(rec.offset).encode()),
        ("dlq_pod", pod_id.encode()),
    ]
    value = rec.value or b""
    if len(value) > MAX_PAYLOAD_BYTES:
        # Over the limit it cannot be produced again (the producer and the broker refuse it, so
        # the batch would rewind forever): the dead letter points at the original instead.
        headers.append(("dlq_value_omitted", str(len(value)).encode()))
        value = b""
    return EncodedRecord(key=rec.key or b"", value=value, headers=headers)
