"""Execution state: the store the pod keeps of its partitions (the compacted topic is the truth)
and its restore on take-over.

* :mod:`.interface`: the store protocol (what the pod, the reaper, replay and session activity use);
* :mod:`.memory`: every state in memory, restored from the beginning on each take-over;
* :mod:`.rocksdb`: one RocksDB database per owned partition on local disk, with a checkpoint;
  its jobs in :mod:`.rocksdb_partition` (one database), :mod:`.rocksdb_databases` (held, opened,
  thrown away), :mod:`.rocksdb_checkpoints` and :mod:`.rocksdb_restore`;
* :mod:`.changelog`: the state topic read from a checkpoint (bounds, topic id, records);
* :mod:`.local_faults`: what a failure of a local database is (its bounded reason) and the marker
  that tells a database lost its data;
* :mod:`.store`: picks an implementation (:func:`.store.open_store`);
* :mod:`.recovery`: restore and resume the outbox of partitions taken over.
"""
