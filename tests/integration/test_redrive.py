"""``sandbox-lanes redrive`` on the real broker, against a real pod: a phase change dead-lettered because
its create came late is written back once the create is applied, and tears the sandbox down exactly
once; a second re-drive writes nothing."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from consumers.ops.settings import load_settings
from consumers.tools.explain import explain, render_text
from consumers.tools.redrive import RedriveReport, print_report, redrive
from consumers.tools.redrive_plan import REDRIVE_COUNT, REDRIVEN_FROM, Filters
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.pod_harness import (
    Received,
    create_inputs,
    produce,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
)

pytestmark = pytest.mark.kafka
RUN = uuid.uuid4().hex[:6]


async def _until(
    bootstrap: str, topic: str, predicate: Callable[[list[Received]], bool], timeout_s: float = 60.0
) -> list[Received]:
    """Read ``topic`` until ``predicate(records)`` holds (a deadline, never a sleep deciding)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = await read_topic(bootstrap, topic, settle_s=0.3, timeout_s=5)
        if predicate(records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{topic}: condition not met in {timeout_s}s; {len(records)} records")
        await asyncio.sleep(0.3)


@pytest.mark.timeout(240)
async def test_a_dead_letter_is_redriven_once_and_decided_once(kafka_bootstrap: str, tmp_path: Path) -> None:
    env = unique_env(
        kafka_bootstrap, tmp_path, SANDBOX_PROVISIONER_TYPE="memory", SANDBOX_LANES_PARTITIONS="1"
    )
    settings = load_settings(env)
    topics = settings.topics
    await create_inputs(env)
    execution = f"wf-redrive-{RUN}"
    terminal = inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution,
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )

    def outcomes_of(records: list[Received]) -> list[str]:
        return [type(r.message).__name__ for r in records if r.key == execution]

    async with running_pod(env):
        # Its phase change before its create (a producer that lost the create and sent it again later).
        await produce(kafka_bootstrap, env, terminal)
        dead = await _until(kafka_bootstrap, topics.dead_letter, lambda rs: len(rs) >= 1)
        assert "phase-changed for unknown execution" in dead[0].headers["dlq_reason"]
        await produce(kafka_bootstrap, env, wf_created(execution))
        await _until(kafka_bootstrap, topics.outcomes, lambda rs: outcomes_of(rs) == ["SandboxProvisioned"])

        async def run(apply: bool) -> RedriveReport:
            return await redrive(
                kafka_bootstrap,
                topics,
                filters=Filters(topic=topics.phase_changed),
                max_redrives=settings.redrive_max,
                retention_s=float(settings.state_retention_s),
                apply=apply,
            )

        dry = await run(False)
        assert [(v.action, v.letter.key) for v in dry.verdicts] == [("redrive", execution.encode())]
        assert dry.written == 0
        applied = await run(True)
        assert applied.written == 1
        out = io.StringIO()
        print_report(applied, applied=True, as_json=False, out=out)
        print("\n" + out.getvalue())

        records = await _until(
            kafka_bootstrap,
            topics.outcomes,
            lambda rs: outcomes_of(rs) == ["SandboxProvisioned", "SandboxDeprovisioned"],
        )
        # The re-driven record on its source topic: the original's bytes and headers, and its story.
        inputs = await read_topic(kafka_bootstrap, topics.phase_changed, settle_s=0.3, timeout_s=5)
        assert len(inputs) == 2
        again = inputs[1]
        assert again.value == terminal.SerializeToString()
        assert again.headers[REDRIVEN_FROM] == applied.verdicts[0].letter.place
        assert applied.verdicts[0].letter.place.startswith(f"{topics.dead_letter}/0/")
        assert again.headers[REDRIVE_COUNT] == "1"

        # A second re-drive: the dead letter was re-driven already; nothing is written.
        second = await run(True)
        assert second.written == 0
        assert [v.action for v in second.verdicts] == ["skip"]
        assert "re-driven already" in second.verdicts[0].why
        assert len(await read_topic(kafka_bootstrap, topics.phase_changed, settle_s=0.3, timeout_s=5)) == 2
    assert outcomes_of(records) == ["SandboxProvisioned", "SandboxDeprovisioned"]

    # Replay and explain tell it as one story: the dead letter, the re-drive, the decision.
    report = await replay(
        kafka_bootstrap,
        topics,
        lane_config(settings),
        guarantee=settings.guarantee,
        max_clock_ahead_s=settings.max_clock_ahead_s,
    )
    assert report.divergences == [], [d.as_dict() for d in report.divergences]
    story = await explain(
        kafka_bootstrap, topics, lane_config(settings), execution, guarantee=settings.guarantee
    )
    text = render_text(story)
    print(text)
    place = applied.verdicts[0].letter.place
    assert f"re-driven (#1) from dead letter {place}, the original {topics.phase_changed}[0]@0" in text
    assert "dead letter: phase-changed for unknown execution" in text
