"""Recovering partitions a pod took over: their state from the compacted topic, then their outbox."""

from __future__ import annotations

import logging
from collections.abc import Callable

from consumers.lanes.outbox import pending_of
from consumers.runtime.effects import EffectRunner
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.state.interface import StateStore

logger = logging.getLogger("sandbox_lanes.pod")


async def restore_and_resume(
    partitions: set[int],
    *,
    owned: Callable[[], set[int]],
    config: PodConfig,
    store: StateStore,
    effects: EffectRunner,
    stats: PodStats,
    metrics: PodMetrics,
) -> None:
    """Rebuild the state of the owned ``partitions`` not yet held, then re-run their pending calls.

    The effects of a restored partition are driver calls decided before (by this pod or the
    previous owner) and never folded back: they run again, idempotent by name and id. A partition
    released (or released and taken again) while its state was read is dropped: that read is not
    its current epoch's.
    """
    missing = (partitions & owned()) - store.owned()
    if not missing:
        return
    epochs = {p: effects.epoch(p) for p in missing}
    report = await store.restore(
        config.bootstrap,
        missing,
        isolation_level="read_committed" if config.guarantee == "exactly_once" else "read_uncommitted",
        security=config.security,
    )
    stats.restored_keys += report.keys
    stats.restore_seconds += report.seconds
    metrics.restored_keys.inc(report.keys)
    metrics.restore_seconds.set(report.seconds)
    now_owned = owned()
    stale = {p for p in missing if p not in now_owned or effects.epoch(p) != epochs[p]}
    if stale:
        store.drop(stale)
        missing -= stale
    metrics.state_keys.set(len(store))
    resumed = 0
    for partition in missing:
        for key, state in store.partition_items(partition):
            for effect_id, command in pending_of(state):
                resumed += effects.submit(partition, key, effect_id, command)
    if resumed:
        logger.info(
            "outbox resumed: driver calls decided before and not completed run again",
            extra={"partitions": ",".join(map(str, sorted(missing))), "calls": resumed},
        )
