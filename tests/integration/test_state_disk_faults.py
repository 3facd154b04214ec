"""The local state is disposable, proven at the disk (issue 42, deliverable 6).

One real pod process on the disk store (``SANDBOX_LANES_STATE_STORE=rocksdb``) and the real broker:
executions provisioned, SIGTERM, a fault on the state directory, the pod started again, then
COMPLETED for every execution. Whatever the fault, the pod is ready within 60 s, every execution is
torn down exactly once after its COMPLETED, nothing is dead-lettered, the store holds what the topic
holds, and each database thrown away is said once (a WARNING with the reason) and counted
(``sandbox_lanes_state_rebuilds_total{reason}``):

* ``current``: each database's ``CURRENT`` overwritten (RocksDB: "Corruption");
* ``manifest``: each ``MANIFEST`` cut to half (RocksDB opens an empty database without a word;
  our marker beside it tells its data is gone);
* ``sst``: 512 bytes scribbled in the middle of each SST file (the databases open; the first read
  of a damaged block fails its checksum);
* ``not_a_directory``: partition 0's directory replaced by a regular file (partition 1 is not held
  back: it resumes from its checkpoint);
* ``backup``: the state directory of an earlier stop copied back in place (no rebuild: each
  partition resumes from the older checkpoint and reads the longer tail);
* ``disk_full``: the state directory on a small tmpfs, filled up while the pod runs: the store
  write of a committed transaction fails; the partition is rebuilt from the topic once room is made
  (this case needs the pod's wiring of :class:`StateStoreFault` to ``discard`` and a restore).

One broker for all; pods are restarted, not brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from consumers.lanes.commands import SCOPE_ENUM, Command, CommandResult
from consumers.ops.settings import load_settings
from consumers.runtime.effects import EffectRunner
from consumers.runtime.kafka.topology import Topics
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod_config import PodConfig, PodStats
from consumers.runtime.state.memory import MemoryStore
from consumers.runtime.state.recovery import restore_and_resume
from consumers.runtime.state.rocksdb import RocksDBStore
from consumers.tools.embedded_broker import free_port
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2, state_pb2
from tests.integration.test_effects_kafka import assert_one_outcome_each, committed_outcomes, memory_env
from tests.integration.test_ops_http import http_get, wait_for_status
from tests.support.chaos_verify import read_all
from tests.support.pod_harness import PodProcess, produce, wf_created, wf_terminal

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]

#: Executions per case (two partitions).
N = 40
FAULTS = ["current", "manifest", "sst", "not_a_directory", "backup", "disk_full"]


@contextlib.contextmanager
def _small_filesystem(path: Path, size: str) -> Iterator[None]:
    """A real tmpfs of ``size`` mounted at ``path`` (root only: the case fails if it cannot mount)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem with one file; returns it."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def _damage(databases: Path, fault: str, backup: Path) -> None:
    """Apply ``fault`` to the stopped pod's databases (``<state dir>/<topic>/<partition>``)."""
    parts = sorted(p for p in databases.iterdir() if p.is_dir())
    assert [p.name for p in parts] == ["0", "1"], parts
    if fault == "current":
        for db in parts:
            (db / "CURRENT").write_text("MANIFEST-000000\x00garbage\n")
    elif fault == "manifest":
        for db in parts:
            (manifest,) = db.glob("MANIFEST-*")
            os.truncate(manifest, manifest.stat().st_size // 2)
    elif fault == "sst":
        for db in parts:
            ssts = list(db.glob("*.sst"))
            assert ssts, f"no SST file in {db}: {os.listdir(db)}"  # the premise
            for sst in ssts:
                with sst.open("r+b") as f:
                    f.seek(sst.stat().st_size // 2)
                    f.write(os.urandom(512))
    elif fault == "not_a_directory":
        shutil.rmtree(parts[0])
        parts[0].write_text("this was a database\n")
    elif fault == "backup":
        shutil.rmtree(databases)
        shutil.copytree(backup, databases)


def _log_lines(pod: PodProcess) -> list[dict[str, object]]:
    lines = []
    for line in pod.log().splitlines():
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                lines.append(found)
    return lines


async def _rebuilds_counted(port: int) -> dict[str, float]:
    _, _, body = await http_get(port, "/metrics")
    counted: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == "sandbox_lanes_state_rebuilds_total":
                counted[sample.labels["reason"]] = sample.value
    return counted


async def _wait_for_outcomes(bootstrap: str, topic: str, kind: type, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = sum(isinstance(r.message, kind) for r in await committed_outcomes(bootstrap, topic))
        if got >= n:
            return
        assert time.monotonic() < deadline, f"{got} of {n} {kind.__name__} after {timeout_s} s"
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_damaged_state_directory_costs_a_rebuild_never_a_sandbox(
    kafka_bootstrap: str, tmp_path: Path, fault: str
) -> None:
    started = time.monotonic()
    state_dir = tmp_path / "state"
    port = free_port()
    env = memory_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_STATE_STORE="rocksdb",
        SANDBOX_LANES_STATE_DIR=str(state_dir),
        SANDBOX_LANES_HTTP_HOST="127.0.0.1",
        SANDBOX_LANES_HTTP_PORT=str(port),
        SANDBOX_LANES_POD_ID=f"pod-{fault}",
    )
    topics = load_settings(env).topics
    databases = state_dir / topics.state
    backup = tmp_path / "backup"
    executions = [f"wfx_disk_{fault}_{i}" for i in range(N)]
    with contextlib.ExitStack() as stack:
        if fault == "disk_full":
            stack.enter_context(_small_filesystem(state_dir, "16m"))
        # Executions provisioned (running), then SIGTERM. The backup case stops once half-way and
        # keeps a copy of the state directory (an operator's backup of the stopped pod's volume).
        first = executions[: N // 2] if fault == "backup" else executions
        runs = [first, executions[N // 2 :]] if fault == "backup" else [first]
        provisioned = 0
        for i, batch in enumerate(runs):
            pod = PodProcess(env, tmp_path / f"pod-{i}.log")
            pod.start()
            await wait_for_status(port, "/readyz", 200, timeout_s=60)
            await produce(kafka_bootstrap, env, *(wf_created(e) for e in batch))
            provisioned += len(batch)
            await _wait_for_outcomes(
                kafka_bootstrap, topics.outcomes, outcomes_pb2.SandboxProvisioned, provisioned, 90
            )
            code, _ = pod.terminate()
            assert code == 0
            if fault == "backup" and i == 0:
                shutil.copytree(databases, backup)
        _damage(databases, fault, backup)

        restarted = PodProcess(env, tmp_path / "pod-restarted.log")
        restarted.start()
        since = time.monotonic()
        await wait_for_status(port, "/readyz", 200, timeout_s=60)  # the spec: ready within 60 s
        ready_s = time.monotonic() - since
        before = await committed_outcomes(kafka_bootstrap, topics.outcomes)
        assert not any(isinstance(r.message, outcomes_pb2.SandboxDeprovisioned) for r in before)
        filler = _fill(state_dir) if fault == "disk_full" else None
        await produce(kafka_bootstrap, env, *(wf_terminal(e) for e in executions))
        if filler is not None:
            # The first store write of a committed transaction fails; once that is said, room is
            # made (as an operator would) and the rebuild from the topic can go through.
            await restarted.wait_for_log("local state thrown away", timeout_s=60)
            filler.unlink()
        await _wait_for_outcomes(kafka_bootstrap, topics.outcomes, outcomes_pb2.SandboxDeprovisioned, N, 120)
        counted = await _rebuilds_counted(port)
        code, _ = restarted.terminate()
        assert code == 0

        lines = _log_lines(restarted)
        thrown = [
            (int(str(r["partition"])), str(r["reason"]))
            for r in lines
            if r.get("msg") == "local state thrown away: the partition is rebuilt from the state topic"
            and r.get("level") == "warning"
        ]
        restored = [r for r in lines if r.get("msg") == "state restored"]
        expected = {
            "current": {(0, "corrupt"), (1, "corrupt")},
            "manifest": {(0, "corrupt"), (1, "corrupt")},
            "sst": {(0, "corrupt"), (1, "corrupt")},
            "not_a_directory": {(0, "not_a_directory")},
            "backup": set(),
        }
        if fault == "disk_full":
            assert thrown and {reason for _, reason in thrown} == {"disk_full"}, thrown
        else:
            assert set(thrown) == expected[fault], thrown
        assert len(thrown) == len(set(thrown)), f"said more than once: {thrown}"  # once per database
        assert counted == dict(Counter(reason for _, reason in thrown)) or (
            not thrown and not any(counted.values())
        ), (counted, thrown)
        if fault == "not_a_directory":  # the healthy partition is not held back
            assert restored[0]["fromCheckpoint"] == 1, restored
        if fault == "backup":  # the older checkpoints, and the tail written since the copy
            assert restored[0]["fromCheckpoint"] == 2 and int(str(restored[0]["records"])) >= N // 2, restored

    # Torn down exactly once each (after its COMPLETED: none was before), provisioned once each,
    # no outcome twice, nothing dead-lettered.
    outcomes = await committed_outcomes(kafka_bootstrap, topics.outcomes)
    assert_one_outcome_each(outcomes, executions, outcomes_pb2.SandboxProvisioned)
    assert_one_outcome_each(outcomes, executions, outcomes_pb2.SandboxDeprovisioned)
    assert await read_all(kafka_bootstrap, topics.dead_letter) == []
    # What the disk store holds is what the topic holds (unless its tmpfs went with the case).
    if fault != "disk_full":
        disk = RocksDBStore(topics.state, directory=state_dir)
        disk.adopt([0, 1])
        full = MemoryStore(topics.state)
        await full.restore(kafka_bootstrap, [0, 1])
        try:
            assert dict(disk.items()) == dict(full.items())
        finally:
            disk.close()
    print(
        f"\n[disk fault {fault}] ready {ready_s:.2f} s after the restart; thrown away {sorted(thrown)};"
        f" restores {[(r.get('records'), r.get('fromCheckpoint'), r.get('rebuilt'), r.get('seconds')) for r in restored]};"
        f" loop stalls {sum(1 for r in lines if r.get('msg', '').startswith('event loop stood still'))};"  # type: ignore[union-attr]
        f" case {time.monotonic() - started:.1f} s"
    )


async def test_a_checkpoint_older_than_the_topics_delete_retention_is_thrown_away(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Finding 13: the state topic's own ``delete.retention.ms`` (read from the broker) bounds a
    checkpoint's age. Two topics, the same records and the same checkpoint age: with Kafka's default
    (a day) the tail is read from the checkpoint; with one second (less the slack for a transaction
    open when the checkpoint was taken: anything past it is stale) the partition is rebuilt."""
    outcomes: dict[str, tuple[int, int, dict[int, str]]] = {}
    for name, configs in [("day", {}), ("second", {"delete.retention.ms": "1000"})]:
        topic = f"stale-{name}-{uuid.uuid4().hex[:8]}"
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            configs = {"cleanup.policy": "compact", **configs}
            await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(10):
                await producer.send_and_wait(topic, _state_bytes(f"e{i}"), key=f"e{i}".encode(), partition=0)
            store = RocksDBStore(topic, directory=tmp_path / name)
            await store.restore(kafka_bootstrap, [0])
            store.close()
            for i in range(10, 15):  # the tail written since: it could hold a tombstone compacted away
                await producer.send_and_wait(topic, _state_bytes(f"e{i}"), key=f"e{i}".encode(), partition=0)
        finally:
            await producer.stop()
        report = await store.restore(kafka_bootstrap, [0])
        outcomes[name] = (report.records, report.from_checkpoint, report.rebuilt)
        assert len(store) == 15
        store.close()
    assert outcomes == {"day": (5, 1, {}), "second": (15, 0, {0: "stale_checkpoint"})}, outcomes


def _state_bytes(key: str) -> bytes:
    state = state_pb2.ExecutionState(execution_id=key, created=True, kind=common_pb2.WORKFLOW_EXECUTION)
    return state.SerializeToString()


async def test_a_discarded_partition_still_owned_is_restored_without_running_a_call_twice(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """What the pod does on a StateStoreFault: ``discard`` the partition, then ``restore_and_resume``
    while it still owns it. The partition is rebuilt from the topic (counted), its outbox resumed,
    and a driver call of it already running is not started again (the runner knows its effect id)."""
    topic = f"discarded-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
    finally:
        await admin.close()
    states = {}
    for i in range(3):  # three executions, each with a teardown in its outbox
        state = state_pb2.ExecutionState(
            execution_id=f"e{i}", created=True, kind=common_pb2.WORKFLOW_EXECUTION
        )
        entry = state.pending.add()
        entry.effect_id, entry.op, entry.sandbox_id = (
            f"teardown-e{i}",
            state_pb2.EFFECT_OP_DEPROVISION,
            f"sb-e{i}",
        )
        entry.scope = next(iter(SCOPE_ENUM.values()))
        states[f"e{i}"] = state
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for key, state in states.items():
            await producer.send_and_wait(topic, state.SerializeToString(), key=key.encode(), partition=0)
    finally:
        await producer.stop()

    started: list[str] = []
    release = asyncio.Event()

    async def run(command: Command) -> CommandResult:
        started.append(command.sandbox_id)
        await release.wait()  # running until the test lets it finish
        return CommandResult(ok=True)

    effects = EffectRunner(run, concurrency=8)
    effects.own([0])
    store = RocksDBStore(topic, directory=tmp_path)
    config = PodConfig(bootstrap=kafka_bootstrap, topics=Topics(state=topic))
    metrics = PodMetrics()
    resume = functools.partial(
        restore_and_resume,
        owned=lambda: {0},
        config=config,
        store=store,
        effects=effects,
        stats=PodStats(),
        metrics=metrics,
    )
    try:
        await resume({0})
        deadline = time.monotonic() + 10
        while len(started) < 3:  # every teardown running
            assert time.monotonic() < deadline, started
            await asyncio.sleep(0.01)
        store.discard({0}, "write_failed")  # as the pod does on a StateStoreFault of partition 0
        assert store.owned() == set()
        await resume({0})
        assert store.owned() == {0} and {k for k, _ in store.items()} == set(states)
        assert metrics.state_rebuilds.labels("write_failed")._value.get() == 1
        release.set()
        assert await effects.wait_idle(10)
        assert sorted(started) == ["sb-e0", "sb-e1", "sb-e2"]  # each once, not again by the rebuild
        assert len(effects.take()) == 3
    finally:
        release.set()
        await effects.cancel()
        store.close()
