"""The RocksDB store's files carry a bloom filter (issue 45): a new execution's reads of keys the store
does not hold (the decide's, then the apply's index and existence reads) are answered by the filter
instead of searching a block of every level. Measured with 2M states held, ids interleaved: a new
execution's store work 24.1 µs of the loop's CPU without it, 8.8 µs with it; in the scale bench the
pod's CPU per event grew 1.40x from 0 to 10M states held without it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from rocksdict import Options

from consumers.runtime.state import rocksdb_databases
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.runtime.state.rocksdb_partition import BLOCK_CACHE_BYTES
from consumers.runtime.state.rocksdb_partition import database_options as rocksdb_databases_options
from events.sandbox_lanes.v1 import common_pb2, state_pb2


def test_the_store_writes_its_files_with_a_bloom_filter(tmp_path: Path) -> None:
    store = RocksDBStore("state", directory=tmp_path)
    store.adopt([0])
    try:
        store.apply(
            0,
            {
                f"exec-{i:05d}": state_pb2.ExecutionState(
                    execution_id=f"exec-{i:05d}", created=True, phase=common_pb2.EXECUTION_IN_PROGRESS
                )
                for i in range(1000)
            },
        )
        store._parts[0].db.flush()  # the memtable to a table file, as RocksDB does once it is full
        tables = list(tmp_path.rglob("*.sst"))
        assert tables, "no table file written"
        for table in tables:
            # A table's properties name its filter policy; without one there is none.
            assert b"rocksdb.BuiltinBloomFilter" in table.read_bytes(), table
        assert store.get(0, "exec-00042") is not None and store.get(0, "exec-00042-new") is None
    finally:
        store.close()


def _states(first: int, n: int) -> dict[str, state_pb2.ExecutionState | None]:
    return {
        f"exec-{i:06d}": state_pb2.ExecutionState(
            execution_id=f"exec-{i:06d}", created=True, phase=common_pb2.EXECUTION_IN_PROGRESS
        )
        for i in range(first, first + n, 2)
    }


def test_a_reopened_store_reads_through_its_filter_and_shared_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart opens existing databases. rocksdict opens an existing database's column families with
    the options it loads from the database's OPTIONS file unless it is given them: the loaded ones had
    no filter and a private block cache, so after every restart each read of a key not held read a data
    block (the scale bench's 10M-state pods: one page-cache read per new execution on the loop)."""
    made: list[Options] = []

    def counted(memtables: Any, cache: Any) -> Options:
        opts = rocksdb_databases_options(memtables, cache)
        opts.enable_statistics()  # RocksDB's own counters, to see what a read did
        made.append(opts)
        return opts

    monkeypatch.setattr(rocksdb_databases, "database_options", counted)
    store = RocksDBStore("state", directory=tmp_path)
    store.adopt([0, 1])
    for partition in (0, 1):
        store.apply(partition, _states(0, 20_000))
        store._parts[partition].db.flush()
    store.close()

    again = RocksDBStore("state", directory=tmp_path)
    again.adopt([0, 1])
    try:
        # held keys are even: an odd one is not held, and within the table file's key range
        assert all(again.get(0, f"exec-{i:06d}") is None for i in range(1, 20_000, 20))
        counters = _tickers(made[-2].get_statistics())
        assert counters["rocksdb.bloom.filter.useful"] >= 900, counters
        assert counters["rocksdb.block.cache.data.miss"] < 100, counters
        # what the reopened databases run with, as RocksDB logged it at their opening: the filter, and
        # one block cache of the store's bound for both (not one of rocksdict's own per database)
        caches = set()
        for log in sorted(tmp_path.rglob("LOG")):
            text = log.read_text()
            assert "filter_policy: bloomfilter" in text, log
            assert re.search(rf"block_cache_options:\s+capacity : {BLOCK_CACHE_BYTES}\n", text), log
            caches.update(re.findall(r"  block_cache: (0x[0-9a-f]+)", text))
        assert len(caches) == 1, caches
    finally:
        again.close()


def _tickers(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"(rocksdb\.[a-z0-9._-]+) COUNT : (\d+)", text)}
