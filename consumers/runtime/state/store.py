"""The execution state store: a view of a compacted Kafka topic, in memory or on local disk.

Keyed by execution id, partitioned exactly like the input topics (partition N of the state topic
holds the keys of partition N of every input). The topic is the truth; a store is a cache rebuilt
by ``restore`` whenever a partition is assigned, which is what a restarted or rebalanced pod
recovers from. :func:`open_store` picks the implementation (``SANDBOX_LANES_STATE_STORE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from consumers.runtime.state.interface import HeldStates, RestoreReport, StateStore
from consumers.runtime.state.memory import MemoryStore

StoreKind = Literal["memory", "rocksdb"]
STORE_KINDS: tuple[StoreKind, ...] = ("memory", "rocksdb")

__all__ = [
    "STORE_KINDS",
    "HeldStates",
    "MemoryStore",
    "RestoreReport",
    "StateStore",
    "StoreKind",
    "open_store",
]


def open_store(
    kind: StoreKind, topic: str, retention_s: float = 0.0, directory: str | Path | None = None
) -> StateStore:
    """A store of ``kind``; ``rocksdb`` keeps its databases under ``directory``."""
    if kind == "memory":
        return MemoryStore(topic, retention_s)
    if kind == "rocksdb":
        if directory is None:
            raise ValueError("the rocksdb state store needs a state directory")
        from consumers.runtime.state.rocksdb import RocksDBStore

        return RocksDBStore(topic, retention_s, directory=directory)
    raise ValueError(f"unknown state store {kind!r} (one of {', '.join(STORE_KINDS)})")
