"""Dead letters carry what operators' tools read (issue 43 item 6): the group, the exception and the
attempts, beside the place and the reason; a refusal by the rules has no exception to name."""

from __future__ import annotations

from aiokafka import ConsumerRecord

from consumers.runtime.dead_letters import (
    Provenance,
    bare_dead_letter,
    dead_letter_record,
    unparsable_dead_letter,
)
from events.codec import header


def _rec() -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord("in", 2, 41, 0, 0, b"wf-1", b"\x0a\x01x", None, 4, 3, [("ce_type", b"t")])


def test_a_given_up_record_names_its_group_exception_and_attempts() -> None:
    why = Provenance("sandbox-lanes", "MessageSizeTooLargeError", "the state record is too large", 3)
    for record in (
        dead_letter_record(_rec(), "its transaction failed 3 times", "pod-a", why),
        bare_dead_letter(_rec(), "its transaction failed 3 times", "pod-a", why),
        unparsable_dead_letter("in", 2, 41, "cannot parse", "pod-a", why),
    ):
        assert header(record.headers, "dlq_consumer_group") == "sandbox-lanes"
        assert header(record.headers, "dlq_exception_class") == "MessageSizeTooLargeError"
        assert header(record.headers, "dlq_exception_message") == "the state record is too large"
        assert header(record.headers, "dlq_attempts") == "3"
        assert header(record.headers, "dlq_source_offset") == "41"


def test_a_refusal_by_the_rules_has_a_group_and_no_exception() -> None:
    record = dead_letter_record(_rec(), "phase-changed for unknown execution", "pod-a", Provenance("g"))
    assert header(record.headers, "dlq_consumer_group") == "g"
    assert header(record.headers, "dlq_exception_class") is None
    assert header(record.headers, "dlq_attempts") == "1"
    assert header(record.headers, "ce_type") == "t"  # the original's headers kept
