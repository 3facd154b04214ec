"""Recovering partitions a pod took over: their state from the compacted topic, then their outbox."""

from __future__ import annotations

import logging
from collections.abc import Callable

from consumers.lanes.outbox import pending_of
from consumers.runtime.effects import EffectRunner
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.state.interface import StateStore, StateStoreFault

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
    previous owner) and never folded back: they run again, idempotent by name and id; one already
    queued or running in the partition's current epoch is not submitted twice (the runner knows its
    effect id), so a partition the pod still owns whose store was :meth:`~StateStore.discard`\\ ed
    is restored by this call too without running a call twice. A partition released (or released
    and taken again) while its state was read is dropped: that read is not its current epoch's.

    A database found damaged while the outbox is read (a block that fails its checksum) is thrown
    away and the partition rebuilt from the topic, once; a second fault raises.
    """
    missing = (partitions & owned()) - store.owned()
    if not missing:
        return
    missing = await _restore(missing, owned, config, store, effects, stats, metrics)
    resumed = 0
    for partition in sorted(missing):
        try:
            resumed += _resume(partition, store, effects)
        except StateStoreFault as fault:
            store.discard({partition}, fault.reason)
            if await _restore({partition}, owned, config, store, effects, stats, metrics):
                resumed += _resume(partition, store, effects)
    if resumed:
        logger.info(
            "outbox resumed: driver calls decided before and not completed run again",
            extra={"partitions": ",".join(map(str, sorted(missing))), "calls": resumed},
        )


async def _restore(
    missing: set[int],
    owned: Callable[[], set[int]],
    config: PodConfig,
    store: StateStore,
    effects: EffectRunner,
    stats: PodStats,
    metrics: PodMetrics,
) -> set[int]:
    """Restore ``missing``; the partitions still owned in the same epoch (the others dropped)."""
    epochs = {p: effects.epoch(p) for p in missing}
    try:
        report = await store.restore(
            config.bootstrap,
            missing,
            isolation_level="read_committed" if config.guarantee == "exactly_once" else "read_uncommitted",
            security=config.security,
        )
    except Exception:
        # Some partitions may be held already (restored before the one that failed): they are
        # the caller's to fetch from now, so their outbox is resumed here (a retry skips them).
        partial = missing & store.owned()
        stale = {p for p in partial if p not in owned() or effects.epoch(p) != epochs[p]}
        store.drop(stale)
        for partition in sorted(partial - stale):
            try:
                _resume(partition, store, effects)
            except StateStoreFault as fault:  # found damaged: thrown away, so the retry rebuilds it
                store.discard({partition}, fault.reason)
        raise
    stats.restored_keys += report.keys
    stats.restore_seconds += report.seconds
    metrics.restored_keys.inc(report.keys)
    metrics.restore_seconds.set(report.seconds)
    for reason in report.rebuilt.values():
        metrics.state_rebuilds.labels(reason).inc()
    now_owned = owned()
    stale = {p for p in missing if p not in now_owned or effects.epoch(p) != epochs[p]}
    if stale:
        store.drop(stale)
    metrics.state_keys.set(len(store))
    return missing - stale


def _resume(partition: int, store: StateStore, effects: EffectRunner) -> int:
    """Submit the partition's pending driver calls again; how many were not already out. Only the
    states with calls pending are read (the store's outbox index): a restart with millions of states
    held would otherwise decode them all at once on the event loop (issue 45)."""
    resumed = 0
    for key, state in store.pending_items(partition):
        for effect_id, command in pending_of(state):
            resumed += effects.submit(partition, key, effect_id, command)
    return resumed
