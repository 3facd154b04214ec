"""Helpers for running the pod against a real broker in tests: unique topics, produce, read back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from google.protobuf.message import Message

from consumers.ops.compose import Composed, compose
from consumers.ops.settings import load_settings
from consumers.tools.topic_io import topic_for
from consumers.tools.topics import create_input_topics
from events.codec import ALL_TYPES, INPUT_TYPES, OUTCOME_TYPES, decode, decode_state, encode, header, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, state_pb2

_ids = itertools.count(1)
ROOT = Path(__file__).resolve().parents[2]
STUB_RUNNER = f"{shlex.quote(sys.executable)} -m consumers.tools.stub_runner"


def unique_env(bootstrap: str, tmp: Path, **overrides: str) -> dict[str, str]:
    """Settings for one isolated pod deployment: own topics, group and driver state dir."""
    tag = f"t{next(_ids)}-{uuid.uuid4().hex[:6]}"
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "SANDBOX_LANES_GROUP_ID": f"sandbox-lanes-{tag}",
        "SANDBOX_LANES_POD_ID": "pod-a",
        "SANDBOX_LANES_PARTITIONS": "2",
        "SANDBOX_LANES_SESSION_TIMEOUT_MS": "6000",
        "SANDBOX_LANES_TOPIC_EXECUTION_CREATED": f"{tag}.execution-created",
        "SANDBOX_LANES_TOPIC_PHASE_CHANGED": f"{tag}.phase-changed",
        "SANDBOX_LANES_TOPIC_SESSION_DELETED": f"{tag}.session-deleted",
        "SANDBOX_LANES_TOPIC_OUTCOMES": f"{tag}.sandbox-outcomes",
        "SANDBOX_LANES_TOPIC_STATE": f"{tag}.sandbox-lanes-state",
        "SANDBOX_LANES_TOPIC_DLQ": f"{tag}.sandbox-lanes-dlq",
        "SANDBOX_LANES_HTTP_PORT": "0",
        "SANDBOX_PROVISIONER_TYPE": "local-process",
        "STIGMER_SANDBOX_RUNNER_COMMAND": STUB_RUNNER,
        "STIGMER_ACTIVITY_ROUTING": "session",
        "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution",
        "STIGMER_DEFAULT_EXECUTION_TARGET": "cloud",
        "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={tmp / 'sandboxes'},grace_seconds=5",
    }
    env.update(overrides)
    return env


@dataclass
class Received:
    topic: str
    key: str
    message: Message | None
    headers: dict[str, str] = field(default_factory=dict)
    value: bytes | None = None
    partition: int = -1


async def produce(
    bootstrap: str, env: dict[str, str], *events: Message, options: dict[str, Any] | None = None
) -> None:
    """Encode and send ``events`` to their topics; ``options`` = extra client options (TLS, SASL)."""
    topics = load_settings(env).topics
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0, **(options or {}))
    await producer.start()
    try:
        for event in events:
            record = encode(event, source="test-producer")
            await producer.send_and_wait(
                topic_for(event, topics), record.value, key=record.key, headers=record.headers
            )
    finally:
        await producer.stop()


async def produce_raw(
    bootstrap: str, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()


async def read_topic(
    bootstrap: str,
    topic: str,
    *,
    at_least: int = 0,
    timeout_s: float = 30.0,
    settle_s: float = 1.0,
    isolation_level: str = "read_committed",
) -> list[Received]:
    """Read a topic from the beginning until ``at_least`` records arrived and it stayed quiet ``settle_s``."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation_level,
    )
    await consumer.start()
    out: list[Received] = []
    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for rec in records:
                    quiet_since = time.monotonic()
                    headers = {k: v.decode() for k, v in rec.headers or ()}
                    message: Message | None
                    ce_type = header(rec.headers, "ce_type")
                    if "dlq_reason" in headers or ce_type not in ALL_TYPES:
                        message = None
                    elif ce_type in OUTCOME_TYPES:
                        message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                    elif ce_type in INPUT_TYPES:
                        message = decode(rec.key, rec.value, rec.headers, allowed=INPUT_TYPES)
                    else:
                        message = decode_state(rec.value) if rec.value is not None else None
                    key = rec.key.decode() if rec.key else ""
                    out.append(Received(topic, key, message, headers, rec.value, rec.partition))
            if len(out) >= at_least and time.monotonic() - quiet_since >= settle_s:
                break
    finally:
        await consumer.stop()
    return out


def latest_states(records: list[Received]) -> dict[str, state_pb2.ExecutionState]:
    states: dict[str, state_pb2.ExecutionState] = {}
    for rec in records:
        if isinstance(rec.message, state_pb2.ExecutionState):
            states[rec.key] = rec.message
    return states


async def create_inputs(env: dict[str, str]) -> None:
    """The producing side's part before a pod starts: the pod never creates its input topics."""
    await create_input_topics(load_settings(env))


def create_inputs_blocking(env: dict[str, str]) -> None:
    """:func:`create_inputs` from synchronous code (a thread of its own: the caller may be in a loop)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, create_inputs(env)).result()


@contextlib.asynccontextmanager
async def running_pod(env: dict[str, str], **compose_kwargs: Any) -> AsyncIterator[Composed]:
    """An in-process pod, ready (partitions assigned, state restored) when the block starts."""
    settings = load_settings(env)
    await create_input_topics(settings)
    composed = compose(settings, logging.getLogger("sandbox_lanes"), **compose_kwargs)
    task = asyncio.create_task(composed.pod.run())
    try:
        ready = asyncio.ensure_future(composed.pod.ready.wait())
        done, _ = await asyncio.wait({ready, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the pod's start-up error
        if ready not in done:
            raise TimeoutError("pod did not become ready in 60s")
        yield composed
    finally:
        composed.pod.request_stop()
        await asyncio.wait_for(task, 40)


class PodProcess:
    """``sandbox-lanes run`` as a real child process, for kill -9 and SIGTERM tests."""

    #: Every pod process started; tests' teardown kills whatever a failed test left running.
    started: ClassVar[list[PodProcess]] = []

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        create_inputs_blocking(self.env)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumers.tools.cli", "run", "--log-level", "info"],
            env={**os.environ, **self.env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        PodProcess.started.append(self)

    @classmethod
    def kill_all(cls) -> None:
        for pod in cls.started:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait(10)
        cls.started.clear()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_for_log(self, needle: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.log():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"pod exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{needle!r} not in pod log after {timeout_s}s:\n{self.log()[-3000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout_s: float = 40.0) -> tuple[int, float]:
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        return code, time.monotonic() - started


def wf_created(execution_id: str) -> inputs_pb2.ExecutionCreated:
    """A CLOUD workflow's creation: the workflow lane provisions its sandbox."""
    return inputs_pb2.ExecutionCreated(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        workflow_execution_target=common_pb2.CLOUD,
    )


def wf_terminal(execution_id: str) -> inputs_pb2.PhaseChanged:
    """IN_PROGRESS -> COMPLETED: the terminal observer tears the workflow's sandbox down."""
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )
