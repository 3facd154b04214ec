"""The cap through kill -9 and a broker restart (issue 44, item 7, chaos).

Three pod processes of one installation (``sandbox-lanes run``, the local-process driver: every
sandbox is a real runner process), a cap of 30 and a burst of workflow creates from 3 organisations.
Each execution completes 1-3 s after its sandbox is provisioned. During the burst one pod is killed
with SIGKILL and restarted, then the broker (the test's own: it is restarted) is restarted. The engine
is the kernel: the test counts the installation's runner processes in /proc every 100 ms.

Verdicts: never more runners than the cap; every execution provisioned once and torn down once (the
outcome topic, read_committed); no runner left; ``replay`` exact (every admission re-derived from the
capacity log).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from harness.kafka_broker import KafkaBroker, prepare

from consumers.ops.settings import load_settings
from consumers.tools.replay import lane_config, replay
from consumers.tools.replay.command import summary_table
from events.codec import OUTCOME_TYPES, decode
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.support.pod_harness import PodProcess, create_inputs, produce, unique_env, wf_created, wf_terminal
from tests.support.proc_util import processes_under

pytestmark = pytest.mark.kafka

CAP = 30
CREATES = 150
ORGS = ("org-burst", "org-b", "org-c")


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    PodProcess.kill_all()
    for pid in processes_under(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
async def test_three_pods_hold_the_cap_through_a_kill_and_a_broker_restart(tmp_path: Path) -> None:
    await asyncio.to_thread(prepare)
    broker = KafkaBroker()
    await asyncio.to_thread(broker.start)
    pods: dict[str, PodProcess] = {}
    try:
        state_dir = tmp_path / "sandboxes"
        state_dir.mkdir()
        env = unique_env(
            broker.bootstrap,
            tmp_path,
            SANDBOX_PROVISIONER_TYPE="local-process",
            STIGMER_SANDBOX_RUNNER_COMMAND=f"{shlex.quote(sys.executable)} -m tests.support.chaos_runner",
            SANDBOX_LANES_DRIVER_OPTIONS=f"state_dir={state_dir},grace_seconds=3",
            CHAOS_RUNNER_MAX_S="600",
            SANDBOX_LANES_PARTITIONS="3",
            SANDBOX_LANES_HTTP_PORT="0",
            SANDBOX_LANES_REAP_INTERVAL_S="0",
            SANDBOX_LANES_MAX_SANDBOXES=str(CAP),
            SANDBOX_LANES_ADMISSION_TIMEOUT_S="600",
        )
        topics = load_settings(env).topics
        await create_inputs(env)

        def start(pod_id: str) -> None:
            pod = PodProcess(
                {**env, "SANDBOX_LANES_POD_ID": pod_id}, tmp_path / f"{pod_id}-{time.monotonic_ns()}.log"
            )
            pod.start()
            pods[pod_id] = pod

        for pod_id in ("pod-a", "pod-b", "pod-c"):
            start(pod_id)
        for pod in pods.values():
            await pod.wait_for_log("pod started", 90)

        most = 0
        sampling = True

        async def sample() -> None:
            nonlocal most
            while sampling:
                most = max(most, len(await asyncio.to_thread(processes_under, tmp_path)))
                await asyncio.sleep(0.1)

        run = uuid.uuid4().hex[:6]
        ids = [f"wf-capch-{run}-{i}" for i in range(CREATES)]
        creates = []
        for i, execution_id in enumerate(ids):
            created = wf_created(execution_id)
            created.org = ORGS[0] if i % 10 < 8 else ORGS[1 + i % 2]
            creates.append(created)
        provisions: Counter[str] = Counter()
        teardowns: Counter[str] = Counter()
        done = asyncio.Event()
        lifetime = random.Random(7)
        completing: list[asyncio.Task[None]] = []

        async def complete_later(execution_id: str) -> None:
            await asyncio.sleep(lifetime.uniform(1.0, 3.0))
            for _ in range(120):  # the broker may be restarting: the producer's retries, bounded
                try:
                    await produce(broker.bootstrap, env, wf_terminal(execution_id))
                    return
                except Exception:
                    await asyncio.sleep(1.0)
            raise AssertionError(f"could not produce {execution_id}'s COMPLETED")

        async def watch() -> None:
            consumer = AIOKafkaConsumer(
                topics.outcomes,
                bootstrap_servers=broker.bootstrap,
                group_id=None,
                auto_offset_reset="earliest",
                isolation_level="read_committed",
            )
            await consumer.start()
            try:
                while not done.is_set():
                    for records in (await consumer.getmany(timeout_ms=200)).values():
                        for rec in records:
                            message: Any = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                            if isinstance(message, outcomes_pb2.SandboxProvisioned):
                                provisions[message.execution_id] += 1
                                completing.append(asyncio.create_task(complete_later(message.execution_id)))
                            elif isinstance(message, outcomes_pb2.SandboxDeprovisioned):
                                teardowns[message.execution_id] += 1
                                if len(teardowns) == CREATES:
                                    done.set()
            finally:
                await consumer.stop()

        sampler = asyncio.create_task(sample())
        watcher = asyncio.create_task(watch())
        await produce(broker.bootstrap, env, *creates)

        # The faults, during the burst: a pod killed and restarted once a quarter of the executions
        # are provisioned, then the broker restarted once half are; neither after the last teardown.
        async def provisioned(n: int) -> None:
            while len(provisions) < n:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(provisioned(CREATES // 4), 120)
        assert len(teardowns) < CREATES, "the burst was over before the kill"
        pods["pod-b"].kill9()
        await asyncio.sleep(1)
        start("pod-b")
        await asyncio.wait_for(provisioned(CREATES // 2), 120)
        assert len(teardowns) < CREATES, "the burst was over before the broker restart"
        await asyncio.to_thread(broker.restart)
        try:
            await asyncio.wait_for(done.wait(), 420)
        finally:
            sampling = False
            await sampler
        await asyncio.gather(*completing)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        exits = {pod_id: pod.proc.poll() for pod_id, pod in pods.items() if pod.proc is not None}
        for pod in pods.values():
            pod.terminate(45)
        print(
            f"\n{CREATES} creates, cap {CAP}, 3 pods, a kill -9 and a broker restart: runners at most {most}"
        )
        assert exits == {"pod-a": None, "pod-b": None, "pod-c": None}, exits  # no pod ended by itself
        assert most <= CAP, f"{most} runner processes at once, over the cap of {CAP}"
        assert provisions == Counter({e: 1 for e in ids}), "each execution provisioned once"
        assert teardowns == Counter({e: 1 for e in ids}), "each execution torn down once"
        assert processes_under(tmp_path) == []  # every runner gone
        report = await replay(broker.bootstrap, topics, lane_config(load_settings(env)), show_progress=False)
        print(summary_table(report))
        assert not report.diverged, [d.as_dict() for d in report.divergences][:5]
        assert report.capacity_answers_matched == report.capacity_answers_recorded >= CREATES
    finally:
        PodProcess.kill_all()
        await asyncio.to_thread(broker.stop)
