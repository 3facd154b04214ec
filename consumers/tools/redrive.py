"""``sandbox-lanes redrive``: list dead letters and, with ``--apply``, write them back to their source.

Reads the dead-letter topic, the input topics (which dead letters were re-driven already) and the
state topic (what was applied since, which executions were removed), decides with
:func:`consumers.tools.redrive_plan.plan`, and prints each verdict. With ``--apply`` each re-driven
record goes back to its source topic and partition with its key, value and original headers, plus
``dlq_redriven_from`` (the dead letter's place) and ``dlq_redrive_count``: the pod then decides it
as any input, and ``explain`` shows the dead letter and the re-driven record side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from aiokafka import AIOKafkaProducer, ConsumerRecord, TopicPartition

from consumers.ops.reaper import partitions_of
from consumers.runtime.kafka.codecs import require_codecs
from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.topology import Topics, TopologyError
from consumers.tools.redrive_plan import (
    REDRIVEN_FROM,
    DeadLetter,
    Filters,
    Verdict,
    World,
    dead_letter,
    plan,
    summary,
)
from events import schema_registry
from events.codec import DecodeError, InputEvent, decode_input, decode_state, header

#: A progress line on stderr every this many records read.
PROGRESS_EVERY = 10_000


@dataclass(frozen=True)
class RedriveReport:
    verdicts: list[Verdict]
    written: int


async def _read(
    bootstrap: str,
    topics: list[str],
    security: KafkaSecurity,
    progress: Callable[[str], None],
    what: str,
) -> list[tuple[TopicPartition, list[ConsumerRecord[bytes, bytes]]]]:
    found = await partitions_of(bootstrap, topics, security=security)
    unseen = [t for t in topics if t not in found]
    if unseen:  # never a plan made without them: no state read = no applied-since or removed check
        raise TopologyError(
            f"cannot read {', '.join(unseen)} ({what}): the topic is missing or this principal may not "
            "describe it (redrive needs Read on the dead-letter, input and state topics)"
        )
    tps = [TopicPartition(t, p) for t, ps in found.items() for p in ps]
    out: list[tuple[TopicPartition, list[ConsumerRecord[bytes, bytes]]]] = []
    read = 0
    async for tp, recs in read_to_end(bootstrap, tps, security=security):
        out.append((tp, list(recs)))
        before, read = read, read + len(recs)
        if read // PROGRESS_EVERY > before // PROGRESS_EVERY:
            progress(f"{what}: {read} records read")
    return out


async def redrive(
    bootstrap: str,
    topics: Topics,
    *,
    filters: Filters,
    max_redrives: int,
    retention_s: float,
    apply: bool,
    force: bool = False,
    security: KafkaSecurity = PLAINTEXT,
    progress: Callable[[str], None] = lambda _line: None,
) -> RedriveReport:
    """Plan (and with ``apply`` write) the re-drive of the dead letters ``filters`` match."""
    letters: list[DeadLetter] = []
    for tp, recs in await _read(bootstrap, [topics.dead_letter], security, progress, "dead letters"):
        for rec in recs:
            letter = dead_letter(
                tp.topic,
                tp.partition,
                rec.offset,
                rec.timestamp,
                rec.key,
                rec.value,
                rec.headers,
            )
            if letter is not None:
                letters.append(letter)
    letters.sort(key=lambda letter: (letter.timestamp_ms, letter.place))
    world = World(now_ms=int(time.time() * 1000), retention_s=retention_s)
    for _tp, recs in await _read(bootstrap, list(topics.inputs), security, progress, "inputs"):
        for rec in recs:
            place = header(rec.headers, REDRIVEN_FROM)
            if place:
                world.redriven.add(place)
    for _tp, recs in await _read(bootstrap, [topics.state], security, progress, "states"):
        for rec in recs:
            key = (rec.key or b"").decode("utf-8", "replace")
            if rec.value is None:
                world.states.pop(key, None)
                world.removed.add(key)
            else:
                world.states[key] = decode_state(rec.value)
                world.removed.discard(key)

    async def decoded(letter: DeadLetter) -> InputEvent | str:
        await schema_registry.ensure(letter.value)
        try:
            return decode_input(
                letter.key, letter.value, letter.headers, topic_carries=topics.carries(letter.source_topic)
            )
        except DecodeError as exc:
            return exc.reason

    results = {letter.place: await decoded(letter) for letter in letters}
    verdicts = plan(
        letters,
        decode=lambda letter: results[letter.place],
        world=world,
        filters=filters,
        max_redrives=max_redrives,
        force=force,
    )
    written = 0
    chosen = [v for v in verdicts if v.action == "redrive"]
    if apply and chosen:
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", **security.client_options()
        )
        await producer.start()
        try:
            for verdict in chosen:
                letter = verdict.letter
                await producer.send_and_wait(
                    letter.source_topic,
                    letter.value,
                    key=letter.key,
                    partition=letter.source_partition if letter.source_partition >= 0 else None,
                    headers=letter.redriven_headers(),
                )
                written += 1
                if written % 1000 == 0:
                    progress(f"re-driven: {written} of {len(chosen)}")
        finally:
            await producer.stop()
    return RedriveReport(verdicts, written)


def _ms(text: str) -> int:
    at = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    return int(at.timestamp() * 1000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--apply", action="store_true", help="write them back (default: print what it would do)"
    )
    parser.add_argument("--reason", help="only dead letters whose dlq_reason contains this text")
    parser.add_argument("--topic", help="only dead letters from this source topic")
    parser.add_argument("--key", help="only dead letters with this record key")
    parser.add_argument("--since", help="only dead letters written at or after this time (ISO 8601)")
    parser.add_argument("--until", help="only dead letters written at or before this time (ISO 8601)")
    parser.add_argument("--count", type=int, help="at most this many dead letters")
    parser.add_argument(
        "--force",
        action="store_true",
        help="also re-drive parked ones and those that could act twice (an old create, an applied event)",
    )
    parser.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON lines")


def _line(verdict: Verdict, applied: bool) -> dict[str, object]:
    letter = verdict.letter
    return {
        "dead_letter": letter.place,
        "source": f"{letter.source_topic}/{letter.source_partition}/{letter.source_offset}",
        "key": (letter.key or b"").decode("utf-8", "replace"),
        "reason": letter.reason,
        "redrive_count": letter.redrive_count,
        "verdict": verdict.action if verdict.action != "redrive" or applied else "would redrive",
        "why": verdict.why,
    }


def print_report(report: RedriveReport, *, applied: bool, as_json: bool, out: TextIO = sys.stdout) -> None:
    for verdict in report.verdicts:
        line = _line(verdict, applied)
        if as_json:
            print(json.dumps(line), file=out)
        else:
            where = f"{line['dead_letter']} -> {line['source']} key={line['key']}"
            print(f"{line['verdict']:>14}  {where}: {line['why']}", file=out)
    counts = summary(report.verdicts)
    verb = "re-driven" if applied else "to re-drive"
    print(
        f"{counts['redrive']} {verb}, {counts['skip']} left out, {counts['parked']} parked"
        + (f"; {report.written} written" if applied else " (dry run: --apply writes them)"),
        file=out if not as_json else sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    from consumers.ops.logs import setup_logging
    from consumers.ops.settings import load_settings

    require_codecs()
    settings = load_settings()
    setup_logging(getattr(args, "log_level", "warning"))
    schema_registry.configure(settings.schema_registry_url)
    filters = Filters(
        reason=args.reason,
        topic=args.topic,
        key=args.key,
        since_ms=_ms(args.since) if args.since else None,
        until_ms=_ms(args.until) if args.until else None,
        count=args.count,
    )
    report = asyncio.run(
        redrive(
            args.bootstrap or settings.bootstrap,
            settings.topics,
            filters=filters,
            max_redrives=settings.redrive_max,
            retention_s=float(settings.state_retention_s),
            apply=args.apply,
            force=args.force,
            security=settings.kafka_security,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    print_report(report, applied=args.apply, as_json=args.json)
    return 0
