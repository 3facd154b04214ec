"""The lane configuration in the log: the record a pod writes when it starts (issue 35).

Every state and outcome the rules produce carries the fingerprint of the configuration it was made
under (``LaneConfig.fingerprint``); this writes the configuration itself, keyed by that fingerprint,
to its own compacted topic (the state topic's name + ``-config``, one partition, created when missing
and the pod creates its topics), when the log has not seen it (that topic is read first: it holds one
record per configuration). Compaction keeps it for as long as the topic lives: replay and ``explain``
find every configuration a retained decision names.

It runs beside the pod's start, not before it: a decision never waits for it. A failure (the broker
away, the topic missing or not writable yet, an ACL not granted yet) is retried with the one backoff
(:class:`resilience.episode.Episode`: one ERROR line when the episode starts, WARNING reminders, a
line when the record is finally written) until the record is written or the pod stops (it cancels
the task :func:`record_lane_config_soon` returns): every decision of the pod's life is then auditable
under its configuration once the world lets the record through. Until then an audit finds the
fingerprint without its record and says so.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from consumers.lanes.commands import LaneConfig
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.topology import TopicSpec, create_missing
from consumers.runtime.pod_config import PodConfig
from events.codec import decode_lane_config, encode_lane_config, lane_config_topic, timestamp
from resilience.episode import Episode

logger = logging.getLogger("sandbox_lanes.pod")

#: The longest one attempt to write the record may take (then it counts as a failure, retried).
RECORD_TIMEOUT_S = 60.0
#: The backoff between attempts: from the first delay, doubling, up to the cap (each attempt opens
#: clients: a minute apart at most keeps a long outage cheap).
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0
#: What the episode log calls the work.
WHAT = "recording the lane configuration"
#: Tasks in flight (a reference, so a running write is not garbage-collected).
_IN_FLIGHT: set[asyncio.Task[None]] = set()


def record_lane_config_soon(cfg: PodConfig, lane: LaneConfig) -> asyncio.Task[None]:
    """Start writing the configuration record beside the caller, retried until written.

    The task never raises (but for its cancellation) and never blocks a decision; the pod cancels
    and awaits it when it stops (a write in progress is then abandoned: the next start writes it).
    """
    task = asyncio.get_running_loop().create_task(
        until_recorded(lane, lambda: record_lane_config(cfg, lane)), name="sandbox-lanes-config-record"
    )
    _IN_FLIGHT.add(task)
    task.add_done_callback(_IN_FLIGHT.discard)
    return task


async def until_recorded(lane: LaneConfig, attempt: Callable[[], Awaitable[None]]) -> None:
    """``attempt`` (one write of ``lane``'s record), bounded by :data:`RECORD_TIMEOUT_S`, until it
    succeeds, with the one backoff in between; one episode log for the failures, and one line at
    its end saying the record was written after all."""
    episode = Episode(
        WHAT,
        logger,
        first_delay_s=FIRST_RETRY_S,
        max_delay_s=MAX_RETRY_S,
        # An episode lasts until the record is written: no pause between attempts ends it.
        settle_s=float("inf"),
        extra={"configFingerprint": lane.fingerprint},
    )
    started = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(attempt(), RECORD_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the world's or a permission not granted yet: waited out
            await asyncio.sleep(episode.failed(exc))
            continue
        if episode.ongoing:
            logger.warning(
                f"{WHAT} succeeded after failing",
                extra={
                    "configFingerprint": lane.fingerprint,
                    "attempts": episode.attempts,
                    "seconds": round(time.monotonic() - started, 3),
                },
            )
        return


async def _recorded(cfg: PodConfig, topic: str, fingerprint: str) -> bool:
    """Whether the log has seen this configuration: its topic (one record per configuration) read.
    A topic not readable yet (just created) counts as not seen: the record is written again, and
    compaction keeps one."""
    try:
        async for _, recs in read_to_end(
            cfg.bootstrap, [TopicPartition(topic, 0)], timeout_s=10.0, security=cfg.security
        ):
            for rec in recs:
                applied = decode_lane_config(rec.value, rec.headers)
                if applied is not None and applied.fingerprint == fingerprint:
                    return True
    except Exception as exc:  # the world's: write it anyway
        logger.debug("configuration topic not read", extra={"topic": topic, "error": repr(exc)[:300]})
    return False


async def record_lane_config(cfg: PodConfig, lane: LaneConfig) -> None:
    """Write ``lane``'s configuration record unless the log has it (an idempotent produce, outside
    every transaction)."""
    topic = lane_config_topic(cfg.topics.state)
    options = cfg.security.client_options()
    if cfg.create_topics:
        spec = TopicSpec(topic, "state", 1, cfg.replication, {"cleanup.policy": "compact"})
        admin = AIOKafkaAdminClient(bootstrap_servers=cfg.bootstrap, **options)
        await admin.start()
        try:
            await create_missing(admin, (spec,))
        finally:
            await admin.close()
    if await _recorded(cfg, topic, lane.fingerprint):
        logger.info(
            "lane configuration already recorded",
            extra={"configFingerprint": lane.fingerprint, "topic": topic},
        )
        return
    applied = lane.applied()
    applied.pod_id = cfg.pod_id
    applied.applied_at.CopyFrom(timestamp(dt.datetime.now(dt.UTC)))
    record = encode_lane_config(applied, source=lane.source)
    producer = AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap, acks="all", enable_idempotence=True, **options
    )
    try:
        await producer.start()  # a failed start is stopped too (no 'Unclosed AIOKafkaProducer')
        await producer.send_and_wait(topic, record.value, key=record.key, headers=record.headers)
    finally:
        await producer.stop()
    logger.info(
        "lane configuration recorded",
        extra={"podId": cfg.pod_id, "configFingerprint": lane.fingerprint, "topic": topic},
    )
