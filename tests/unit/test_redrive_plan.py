"""Which dead letters ``sandbox-lanes redrive`` writes back, read from dead letters the runtime's own
``dead_letter_record`` builds, and why it leaves the others out."""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka import ConsumerRecord

from consumers.runtime.dead_letters import bare_dead_letter, dead_letter_record
from consumers.tools.redrive_plan import (
    REDRIVE_COUNT,
    REDRIVEN_FROM,
    DeadLetter,
    Filters,
    World,
    dead_letter,
    plan,
)
from events.codec import DecodeError, InputEvent, decode_input, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2

CREATED = "sandbox_lanes.v1.ExecutionCreated"
NOW_MS = 1_800_000_000_000


def _record(
    event: inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged,
    offset: int,
    extra: Sequence[tuple[str, bytes]] = (),
) -> ConsumerRecord[bytes, bytes]:
    encoded = encode(event)
    headers = [*encoded.headers, *extra]
    return ConsumerRecord(
        "execution-created",
        0,
        offset,
        NOW_MS,
        0,
        encoded.key,
        encoded.value,
        None,
        len(encoded.key),
        len(encoded.value),
        headers,
    )


def _created(execution_id: str) -> inputs_pb2.ExecutionCreated:
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(), kind=common_pb2.WORKFLOW_EXECUTION, execution_id=execution_id
    )


def _letter(
    event: inputs_pb2.ExecutionCreated,
    offset: int,
    reason: str = "boom",
    extra: Sequence[tuple[str, bytes]] = (),
    at_ms: int = NOW_MS,
) -> DeadLetter:
    encoded = dead_letter_record(_record(event, offset, extra), reason, "pod-1")
    letter = dead_letter("dlq", 0, offset, at_ms, encoded.key, encoded.value, encoded.headers)
    assert letter is not None
    return letter


def _decode(letter: DeadLetter) -> InputEvent | str:
    try:
        return decode_input(letter.key, letter.value, letter.headers, topic_carries=CREATED)
    except DecodeError as exc:
        return exc.reason


def _plan(letters: list[DeadLetter], world: World | None = None, **kwargs: object) -> list[tuple[str, str]]:
    verdicts = plan(
        letters,
        decode=_decode,
        world=world or World(now_ms=NOW_MS),
        filters=kwargs.pop("filters", Filters()),  # type: ignore[arg-type]
        max_redrives=3,
        **kwargs,  # type: ignore[arg-type]
    )
    return [(v.action, v.why) for v in verdicts]


def test_a_dead_letter_keeps_the_original_and_the_redrive_headers_name_its_place() -> None:
    event = _created("wf-a")
    letter = _letter(event, 7, "missing ce_type header")
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("execution-created", 0, 7)
    assert letter.reason == "missing ce_type header" and letter.value == event.SerializeToString()
    assert [k for k, _ in letter.headers] == [k for k, _ in encode(event).headers]  # no dlq_* envelope
    headers = dict(letter.redriven_headers())
    assert headers[REDRIVEN_FROM] == b"dlq/0/7" and headers[REDRIVE_COUNT] == b"1"
    # Dead-lettered again after a re-drive: the count goes on, the place is the new dead letter's.
    again = _letter(event, 9, extra=[(REDRIVEN_FROM, b"dlq/0/7"), (REDRIVE_COUNT, b"1")])
    assert again.redrive_count == 1
    assert dict(again.redriven_headers())[REDRIVE_COUNT] == b"2"
    assert dict(again.redriven_headers())[REDRIVEN_FROM] == b"dlq/0/9"


def test_what_is_redriven_and_what_is_left_out_and_why() -> None:
    fresh = _letter(_created("wf-fresh"), 1)
    done = _letter(_created("wf-done"), 2)
    applied_event = _created("wf-applied")
    applied = _letter(applied_event, 3)
    removed = _letter(_created("wf-removed"), 4)
    old = _letter(_created("wf-old"), 5, at_ms=NOW_MS - 7_200_000)
    parked = _letter(_created("wf-parked"), 6, extra=[(REDRIVE_COUNT, b"3")])
    broken = _created("wf-broken")
    broken.meta.event_id = ""
    refused = _letter(broken, 7)
    world = World(
        redriven={done.place},
        states={"wf-applied": state_pb2.ExecutionState(applied_event_ids=[applied_event.meta.event_id])},
        removed={"wf-removed"},
        now_ms=NOW_MS,
        retention_s=3600,
    )
    verdicts = _plan([fresh, done, applied, removed, old, parked, refused], world)
    assert [action for action, _ in verdicts] == ["redrive", "skip", "skip", "skip", "skip", "parked", "skip"]
    whys = [why for _, why in verdicts]
    assert "re-driven already" in whys[1]
    assert "was applied since" in whys[2]
    assert "finished and was removed" in whys[3]
    assert "past the state retention" in whys[4]
    assert "SANDBOX_LANES_REDRIVE_MAX=3" in whys[5]
    assert whys[6] == "still refused: missing meta.event_id"
    forced = _plan([applied, removed, old, parked, refused, done], world, force=True)
    assert [a for a, _ in forced] == ["redrive", "redrive", "redrive", "redrive", "skip", "skip"]


def test_a_bare_dead_letter_has_nothing_to_write_back() -> None:
    encoded = bare_dead_letter(_record(_created("wf-bare"), 1), "too big", "pod-1")
    letter = dead_letter("dlq", 0, 1, NOW_MS, encoded.key, encoded.value, encoded.headers)
    assert letter is not None
    assert _plan([letter]) == [
        (
            "skip",
            "its original is not whole (dlq_key_truncated, dlq_value_truncated, dlq_headers_omitted): "
            "nothing to write back",
        )
    ]


def test_filters() -> None:
    letters = [_letter(_created(f"wf-{i}"), i, reason=f"reason {i % 2}", at_ms=NOW_MS + i) for i in range(6)]
    assert len(_plan(letters, filters=Filters(reason="reason 1"))) == 3
    assert len(_plan(letters, filters=Filters(key="wf-2"))) == 1
    assert len(_plan(letters, filters=Filters(topic="phase-changed"))) == 0
    assert len(_plan(letters, filters=Filters(since_ms=NOW_MS + 2, until_ms=NOW_MS + 4))) == 3
    assert len(_plan(letters, filters=Filters(count=2))) == 2
    assert dead_letter("dlq", 0, 1, NOW_MS, b"k", b"v", [("ce_type", b"x")]) is None  # not a dead letter
