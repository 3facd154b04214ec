"""The lane configuration in the log: the record a pod writes when it starts (issue 35).

Every state and outcome the rules produce carries the fingerprint of the configuration it was made
under (``LaneConfig.fingerprint``); this writes the configuration itself, keyed by that fingerprint,
to its own compacted topic (the state topic's name + ``-config``, one partition, created when missing
and the pod creates its topics), when the log has not seen it (that topic is read first: it holds one
record per configuration). Compaction keeps it for as long as the topic lives: replay and ``explain``
find every configuration a retained decision names.

It runs beside the pod's start, not before it: a decision never waits for it, and a failure (the
topic cannot be created or written, e.g. an ACL that does not grant it) is one warning, not a pod
that does not start. An audit then finds the fingerprint without its record and says so.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from consumers.lanes.commands import LaneConfig
from consumers.runtime.kafka.topic_reader import read_to_end
from consumers.runtime.kafka.topology import TopicSpec, create_missing
from consumers.runtime.pod_config import PodConfig
from events.codec import decode_lane_config, encode_lane_config, lane_config_topic, timestamp

logger = logging.getLogger("sandbox_lanes.pod")

#: The longest the record's write may take before it is given up (one warning).
RECORD_TIMEOUT_S = 60.0
#: Tasks in flight (a reference, so a running write is not garbage-collected).
_IN_FLIGHT: set[asyncio.Task[None]] = set()


def record_lane_config_soon(cfg: PodConfig, lane: LaneConfig) -> asyncio.Task[None]:
    """Start :func:`record_lane_config` beside the caller; it never raises."""
    task = asyncio.get_running_loop().create_task(_bounded(cfg, lane), name="sandbox-lanes-config-record")
    _IN_FLIGHT.add(task)
    task.add_done_callback(_IN_FLIGHT.discard)
    return task


async def _bounded(cfg: PodConfig, lane: LaneConfig) -> None:
    try:
        await asyncio.wait_for(record_lane_config(cfg, lane), RECORD_TIMEOUT_S)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the world's or a permission: the pod runs on, the audit says so
        logger.warning(
            "lane configuration not recorded",
            extra={"configFingerprint": lane.fingerprint, "error": repr(exc)[:300]},
        )


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
    await producer.start()
    try:
        await producer.send_and_wait(topic, record.value, key=record.key, headers=record.headers)
    finally:
        await producer.stop()
    logger.info(
        "lane configuration recorded",
        extra={"podId": cfg.pod_id, "configFingerprint": lane.fingerprint, "topic": topic},
    )
