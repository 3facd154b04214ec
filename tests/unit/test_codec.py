"""The event contracts and their codec: headers, strict decoding, generated code freshness."""

from __future__ import annotations

import pytest
from harness import gen_protos

from events.codec import DecodeError, decode, encode, new_meta, record_key, state_key
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2, state_pb2


def created() -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(event_id="ev-1", source="producer-a"),
        kind=common_pb2.AGENT_EXECUTION,
        execution_id="axr_1",
        session_id="ses_1",
    )


def test_round_trip_with_cloudevents_headers_and_the_session_id_as_an_agent_executions_key() -> None:
    event = created()
    record = encode(event)
    headers = dict(record.headers)
    assert headers["ce_type"] == b"sandbox_lanes.v1.ExecutionCreated"
    assert headers["ce_id"] == b"ev-1" and headers["ce_source"] == b"producer-a"
    assert headers["ce_specversion"] == b"1.0" and headers["content-type"] == b"application/protobuf"
    assert headers["ce_time"].endswith(b"Z")
    assert record.key == b"ses_1"
    assert decode(record.key, record.value, record.headers) == event


def test_the_session_lanes_inputs_are_keyed_by_session_and_the_rest_by_execution() -> None:
    agent, workflow = common_pb2.AGENT_EXECUTION, common_pb2.WORKFLOW_EXECUTION
    cases = [
        (inputs_pb2.ExecutionCreated(kind=agent, execution_id="axr_1", session_id="ses_1"), "ses_1"),
        (inputs_pb2.PhaseChanged(kind=agent, execution_id="axr_1", session_id="ses_1"), "ses_1"),
        (inputs_pb2.SessionDeleted(session_id="ses_1"), "ses_1"),
        (inputs_pb2.ExecutionCreated(kind=agent, execution_id="axr_2"), "axr_2"),  # no session
        (inputs_pb2.ExecutionCreated(kind=workflow, execution_id="wfx_1"), "wfx_1"),
        (inputs_pb2.PhaseChanged(kind=workflow, execution_id="wfx_1"), "wfx_1"),
    ]
    for message, key in cases:
        assert record_key(message) == key
    # The state an event applies to stays the execution's (or the session's own record).
    assert [state_key(m) for m, _ in cases] == ["axr_1", "axr_1", "ses_1", "axr_2", "wfx_1", "wfx_1"]


def test_an_agent_execution_keyed_by_its_execution_id_is_refused_with_the_reason() -> None:
    record = encode(created())
    with pytest.raises(DecodeError) as err:
        decode(b"axr_1", record.value, record.headers)
    assert err.value.reason == (
        "record key 'axr_1' does not match 'ses_1' (an agent execution's events are keyed by its session id)"
    )


def test_session_outcomes_are_keyed_by_session_id() -> None:
    out = outcomes_pb2.SandboxDeprovisioned(sandbox=common_pb2.SandboxRef(sandbox_id="ses_9"))
    assert record_key(out) == "ses_9"
    assert record_key(inputs_pb2.SessionDeleted(session_id="ses_9")) == "ses_9"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda k, v, h: (k, v, [x for x in h if x[0] != "ce_type"]), "missing ce_type header"),
        (
            lambda k, v, h: (k, v, [("ce_type", b"sandbox_lanes.v1.Nope")]),
            "unknown event type 'sandbox_lanes.v1.Nope'",
        ),
        (lambda k, v, h: (None, v, h), "missing record key"),
        (lambda k, v, h: (b"axr_other", v, h), "does not match"),
        (lambda k, v, h: (k, b"\xff\xff\xff", h), "payload does not decode"),
        (lambda k, v, h: (k, v[: len(v) // 2], h), "payload does not decode"),
        (lambda k, v, h: (k, None, h), "tombstone"),
        (lambda k, v, h: (k, b"\x00" * (1 << 21), h), "exceeds"),
        # field 2 (kind) = 99: an enum number this contract does not know
        (lambda k, v, h: (k, v + b"\x10\x63", h), "unknown enum value 99 for field kind"),
    ],
)
def test_bad_records_raise_a_decode_error_naming_the_reason(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    record = encode(created())
    key, value, headers = mutate(record.key, record.value, record.headers)
    with pytest.raises(DecodeError) as err:
        decode(key, value, headers)
    assert reason in err.value.reason


def test_missing_ids_and_kind_are_refused() -> None:
    for message, reason in [
        (
            inputs_pb2.ExecutionCreated(kind=common_pb2.AGENT_EXECUTION, execution_id="a"),
            "missing meta.event_id",
        ),
        (
            inputs_pb2.ExecutionCreated(meta=new_meta(), kind=common_pb2.AGENT_EXECUTION),
            "missing execution_id",
        ),
        (inputs_pb2.PhaseChanged(meta=new_meta(), execution_id="a"), "missing kind"),
        (inputs_pb2.SessionDeleted(meta=new_meta()), "missing session_id"),
    ]:
        record = encode(message)
        with pytest.raises(DecodeError, match=reason):
            decode(record.key or b"a", record.value, record.headers)


def test_state_is_not_accepted_as_an_input() -> None:
    record = encode(state_pb2.ExecutionState(execution_id="axr_1"))
    with pytest.raises(DecodeError, match="unknown event type"):
        decode(record.key, record.value, record.headers)


def test_generated_code_is_current() -> None:
    """Fails when a .proto changed without ``python -m harness.gen_protos``."""
    assert gen_protos.main(["--check"]) == 0
