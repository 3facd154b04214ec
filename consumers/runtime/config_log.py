"""The lane configuration in the log: the record a pod writes when it starts (issue 35).

Every state and outcome the rules produce carries the fingerprint of the configuration it was made
under (``LaneConfig.fingerprint``); this writes the configuration itself, once per start, to the
compacted state topic under ``lane-config/<fingerprint>``. Compaction keeps one record per key, so
a configuration the log has seen is not kept twice, and it stays as long as the topic does: replay
and ``explain`` find every configuration a retained decision names.
"""

from __future__ import annotations

import datetime as dt
import logging

from aiokafka import AIOKafkaProducer

from consumers.lanes.commands import LaneConfig
from consumers.runtime.pod_config import PodConfig
from events.codec import encode, lane_config_record, timestamp

logger = logging.getLogger("sandbox_lanes.pod")


async def record_lane_config(cfg: PodConfig, lane: LaneConfig) -> str:
    """Write ``lane``'s configuration record to the state topic; returns its fingerprint.

    A plain (idempotent) produce: the record belongs to no input partition's transaction, and a
    ``read_committed`` reader sees it at once.
    """
    applied = lane.applied()
    applied.pod_id = cfg.pod_id
    applied.applied_at.CopyFrom(timestamp(dt.datetime.now(dt.UTC)))
    record = encode(lane_config_record(applied))
    producer = AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap, acks="all", enable_idempotence=True, **cfg.security.client_options()
    )
    await producer.start()
    try:
        await producer.send_and_wait(cfg.topics.state, record.value, key=record.key, headers=record.headers)
    finally:
        await producer.stop()
    logger.info(
        "lane configuration recorded",
        extra={"podId": cfg.pod_id, "configFingerprint": lane.fingerprint, **lane.settings()},
    )
    return lane.fingerprint
