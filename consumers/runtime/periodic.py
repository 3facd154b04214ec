"""The pod's periodic work beside its loop: the state checkpoints, and the probe of the cluster.

Each runs in a task of its own until the pod's stop event is set; a failure of either is an episode
(one ERROR, reminders while it lasts, one line when it ends), never a reason to stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from aiokafka import AIOKafkaConsumer

from consumers.runtime.failure_policy import Action, Site, classify, decide
from consumers.runtime.ownership import Ownership
from consumers.runtime.shutdown import stopped_within
from consumers.runtime.state.interface import CHECKPOINT_INTERVAL_S, StateStoreFault
from consumers.runtime.state.store import StateStore
from resilience.episode import Episode

logger = logging.getLogger("sandbox_lanes.pod")

#: How often the cluster is probed, and how long a probe may wait for its answer.
PROBE_EVERY_S: Final = 5.0
PROBE_TIMEOUT_S: Final = 10.0


async def move_checkpoints(store: StateStore, ownership: Ownership, stop: asyncio.Event) -> None:
    """Every few seconds, off the turn, the store's checkpoints move forward (a disk store: see
    :meth:`RocksDBStore.checkpoint`); one that fails leaves them where they were (a longer
    tail), or, the local state's fault, has the partition rebuilt (the failure policy)."""
    episode = Episode(
        "moving the state checkpoints", logger, first_delay_s=CHECKPOINT_INTERVAL_S, max_delay_s=60.0
    )
    delay = CHECKPOINT_INTERVAL_S
    while not stop.is_set():
        if await stopped_within(stop, delay):
            return
        try:
            await store.checkpoint({p for p in ownership.owned if ownership.fetchable(p)} & store.owned())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delay = max(CHECKPOINT_INTERVAL_S, episode.failed(exc))
            if decide(Site.CHECKPOINT, classify(exc)).action is Action.REBUILD and isinstance(
                exc, StateStoreFault
            ):
                async with ownership.batch_lock:  # never beneath a transaction of its own
                    ownership.rebuild(exc.partition, exc.reason)
            continue
        delay = CHECKPOINT_INTERVAL_S
        episode.recovered()


async def watch_cluster(current_consumer: Callable[[], AIOKafkaConsumer | None], stop: asyncio.Event) -> None:
    """Whether the cluster can be reached at all, as an episode of its own.

    Through a whole outage aiokafka's fetch just returns nothing (its retries are its own), so
    no turn fails and nothing of the pod's would say the cluster is gone. A metadata request
    every few seconds, bounded, says it: one ERROR when the cluster cannot be reached, a
    reminder while it lasts, one line when it is back."""
    episode = Episode(
        "reaching the Kafka cluster", logger, first_delay_s=PROBE_EVERY_S, max_delay_s=PROBE_EVERY_S
    )
    while not stop.is_set():
        await stopped_within(stop, PROBE_EVERY_S)
        client = current_consumer()
        if stop.is_set() or client is None:
            return
        try:
            await asyncio.wait_for(client.topics(), PROBE_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            episode.failed(f"no metadata answer within {PROBE_TIMEOUT_S:.0f} s")
            continue
        except Exception as exc:  # the world's, by definition here
            episode.failed(exc)
            continue
        episode.recovered()
