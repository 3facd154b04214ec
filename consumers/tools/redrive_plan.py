"""Which dead letters ``sandbox-lanes redrive`` writes back to their source topic, and why not the others.

Pure: the tool reads the topics (:mod:`consumers.tools.redrive`), this decides. A dead letter is
re-driven only when writing it back cannot act twice:

* its bytes are whole (not cut to fit, not an unparsable record's empty envelope);
* it was not re-driven already (a record on its source topic names it in ``dlq_redriven_from``);
* it decodes now (the cause is fixed: a still-refused record would only be dead-lettered again);
* its event was not applied since (its id is in its execution's ``applied_event_ids``);
* it is not a create whose execution may have finished and been removed: the pod's de-duplication
  forgets an execution after its state's retention, so a create whose execution's state was removed,
  or that is older than the retention (a removal may have been compacted away), would start it again;
* it was re-driven fewer than ``SANDBOX_LANES_REDRIVE_MAX`` times (else it is *parked*).

``--force`` re-drives what is left out for the last three reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from events.codec import Headers, InputEvent, header, state_key
from events.sandbox_lanes.v1 import inputs_pb2, state_pb2

#: Headers a re-driven record carries: the dead letter's place (``topic/partition/offset``) and how
#: many times this event has been re-driven (1 the first time).
REDRIVEN_FROM: Final = "dlq_redriven_from"
REDRIVE_COUNT: Final = "dlq_redrive_count"
#: The dead-letter envelope's own headers (everything else on a dead letter is the original's).
_ENVELOPE_PREFIXES: Final = ("dlq_",)
_KEPT_FROM_ORIGINAL: Final = frozenset({REDRIVEN_FROM, REDRIVE_COUNT})
_CUT_MARKS: Final = ("dlq_key_truncated", "dlq_value_truncated", "dlq_headers_omitted", "dlq_unparsable")

Action = Literal["redrive", "skip", "parked"]


@dataclass(frozen=True)
class DeadLetter:
    """One record of the dead-letter topic: where it is, why, and the original it keeps."""

    place: str  # "dlq-topic/partition/offset"
    timestamp_ms: int
    reason: str
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes | None
    #: The original's headers (the envelope's own ``dlq_*`` left out, a previous re-drive's kept).
    headers: tuple[tuple[str, bytes], ...]
    #: Why its bytes are not whole ("" = whole).
    cut: str = ""

    @property
    def redrive_count(self) -> int:
        try:
            return int(header(self.headers, REDRIVE_COUNT) or 0)
        except ValueError:
            return 0

    def redriven_headers(self) -> list[tuple[str, bytes]]:
        """What the re-driven record carries: the original headers, its place and the new count."""
        kept = [(k, v) for k, v in self.headers if k not in _KEPT_FROM_ORIGINAL]
        return [
            *kept,
            (REDRIVEN_FROM, self.place.encode()),
            (REDRIVE_COUNT, str(self.redrive_count + 1).encode()),
        ]


def dead_letter(topic: str, partition: int, offset: int, timestamp_ms: int, key: bytes | None,
                value: bytes | None, headers: Headers) -> DeadLetter | None:  # fmt: skip
    """A dead-letter record read back; None for a record that is no dead letter (no envelope)."""
    reason = header(headers, "dlq_reason")
    source = header(headers, "dlq_source_topic")
    if reason is None or not source:
        return None
    try:
        source_partition = int(header(headers, "dlq_source_partition") or -1)
        source_offset = int(header(headers, "dlq_source_offset") or -1)
    except ValueError:
        return None
    marks = [name for name in _CUT_MARKS if header(headers, name) is not None]
    original = tuple(
        (k, v or b"") for k, v in headers if not k.startswith(_ENVELOPE_PREFIXES) or k in _KEPT_FROM_ORIGINAL
    )
    return DeadLetter(
        place=f"{topic}/{partition}/{offset}",
        timestamp_ms=timestamp_ms,
        reason=reason,
        source_topic=source,
        source_partition=source_partition,
        source_offset=source_offset,
        key=key,
        value=value,
        headers=original,
        cut=", ".join(marks),
    )


@dataclass(frozen=True)
class Filters:
    reason: str | None = None
    topic: str | None = None
    key: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    count: int | None = None

    def match(self, letter: DeadLetter) -> bool:
        if self.reason is not None and self.reason not in letter.reason:
            return False
        if self.topic is not None and letter.source_topic != self.topic:
            return False
        if self.key is not None and (letter.key or b"").decode("utf-8", "replace") != self.key:
            return False
        if self.since_ms is not None and letter.timestamp_ms < self.since_ms:
            return False
        return self.until_ms is None or letter.timestamp_ms <= self.until_ms


@dataclass(frozen=True)
class Verdict:
    letter: DeadLetter
    action: Action
    why: str


@dataclass
class World:
    """What the topics say now: places already re-driven, executions' states, removed executions."""

    redriven: set[str] = field(default_factory=set)
    states: dict[str, state_pb2.ExecutionState] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    now_ms: int = 0
    #: The state retention (0 = states are never removed).
    retention_s: float = 0.0


def plan(
    letters: Iterable[DeadLetter],
    *,
    decode: Callable[[DeadLetter], InputEvent | str],
    world: World,
    filters: Filters,
    max_redrives: int,
    force: bool = False,
) -> list[Verdict]:
    """Each matching dead letter's verdict, in the dead-letter topic's order (``filters.count`` at most)."""
    out: list[Verdict] = []
    for letter in letters:
        if not filters.match(letter):
            continue
        if filters.count is not None and len(out) >= filters.count:
            break
        out.append(_verdict(letter, decode, world, max_redrives, force))
    return out


def _verdict(
    letter: DeadLetter,
    decode: Callable[[DeadLetter], InputEvent | str],
    world: World,
    max_redrives: int,
    force: bool,
) -> Verdict:
    if letter.cut:
        return Verdict(letter, "skip", f"its original is not whole ({letter.cut}): nothing to write back")
    if letter.place in world.redriven:
        return Verdict(letter, "skip", "re-driven already (a record on its source topic names it)")
    decoded = decode(letter)
    if isinstance(decoded, str):
        return Verdict(letter, "skip", f"still refused: {decoded}")
    if letter.redrive_count >= max_redrives and not force:
        return Verdict(
            letter,
            "parked",
            f"re-driven {letter.redrive_count} times (SANDBOX_LANES_REDRIVE_MAX={max_redrives})",
        )
    if force:
        return Verdict(letter, "redrive", "forced")
    key = state_key(decoded)
    state = world.states.get(key)
    if state is not None and decoded.meta.event_id in state.applied_event_ids:
        return Verdict(letter, "skip", f"its event {decoded.meta.event_id} was applied since")
    if isinstance(decoded, inputs_pb2.ExecutionCreated) and state is None:
        if key in world.removed:
            return Verdict(
                letter, "skip", f"execution {key} finished and was removed: a create would start it again"
            )
        age_s = (world.now_ms - letter.timestamp_ms) / 1000
        if world.retention_s > 0 and age_s > world.retention_s:
            return Verdict(
                letter,
                "skip",
                f"a create {age_s:.0f}s old, past the state retention ({world.retention_s:g}s): "
                "its execution may have finished and been forgotten",
            )
    return Verdict(letter, "redrive", letter.reason)


def summary(verdicts: Sequence[Verdict]) -> dict[str, int]:
    counts = {"redrive": 0, "skip": 0, "parked": 0}
    for verdict in verdicts:
        counts[verdict.action] += 1
    return counts
