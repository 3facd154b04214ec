"""The lane configuration record is retried until written (issue 42, finding 16).

Before, it was written once: after one transient failure (or with its topic missing) no decision of the
pod's life could be audited under its configuration, and one warning said so. Now the write is retried
with the one backoff (``resilience.episode.Episode``) beside the pod, one ERROR line per episode, a line
when it is written after all, and it stops when the pod cancels it. The write itself, on the real broker,
is tests/integration/test_audit.py; here the retry loop, against real aiokafka clients that find no
broker on a closed loopback port, and with an attempt that fails twice then succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError

from consumers.lanes.commands import LaneConfig
from consumers.lanes.dispatch import AgentExecutionTemporalConfig, WorkflowExecutionTemporalConfig
from consumers.ops.compose import pod_config
from consumers.ops.settings import load_settings
from consumers.runtime import config_log
from tests.support.pod_harness import unique_env

LANE = LaneConfig(
    enabled=True,
    agent=AgentExecutionTemporalConfig(activity_routing="session", default_execution_target="cloud"),
    workflow=WorkflowExecutionTemporalConfig(workflow_activity_routing="execution"),
    driver_name="memory",
)
STARTED = f"{config_log.WHAT} failed; retrying with backoff until it succeeds"
AGAIN = f"{config_log.WHAT} failed again"
DONE = f"{config_log.WHAT} succeeded after failing"


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_log, "FIRST_RETRY_S", 0.01)
    monkeypatch.setattr(config_log, "MAX_RETRY_S", 0.05)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == message]


async def test_no_broker_is_retried_with_one_error_line_until_the_pod_stops_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sandbox_lanes.pod")
    env = unique_env(f"127.0.0.1:{_closed_port()}", tmp_path, SANDBOX_PROVISIONER_TYPE="memory")
    task = config_log.record_lane_config_soon(pod_config(load_settings(env)), LANE)
    deadline = time.monotonic() + 30
    while len(_lines(caplog, AGAIN)) < 3:  # three retries after the first failure, each a real one
        assert not task.done(), task
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records][-10:]
        await asyncio.sleep(0.02)
    (error,) = _lines(caplog, STARTED)
    assert error.levelno == logging.ERROR
    assert error.__dict__["configFingerprint"] == LANE.fingerprint
    assert "KafkaConnectionError" in error.__dict__["error"]
    assert all(r.levelno == logging.DEBUG for r in _lines(caplog, AGAIN))
    # The pod stops: it cancels the task, which ends at once (no write left running).
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)
    assert task in done and task.cancelled()
    assert _lines(caplog, DONE) == []
    assert len(_lines(caplog, STARTED)) == 1


async def test_a_transient_failure_is_retried_until_the_record_is_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="sandbox_lanes.pod")
    attempts: list[float] = []

    async def attempt() -> None:
        attempts.append(time.monotonic())
        if len(attempts) <= 2:
            raise KafkaConnectionError("broker away")

    await asyncio.wait_for(config_log.until_recorded(LANE, attempt), 10)
    assert len(attempts) == 3
    assert len(_lines(caplog, STARTED)) == 1 and len(_lines(caplog, AGAIN)) == 1
    (done,) = _lines(caplog, DONE)
    assert done.levelno == logging.WARNING and done.__dict__["attempts"] == 2


async def test_written_at_once_logs_no_episode(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sandbox_lanes.pod")
    calls: list[int] = []

    async def attempt() -> None:
        calls.append(1)

    await asyncio.wait_for(config_log.until_recorded(LANE, attempt), 10)
    assert calls == [1]
    assert not any(config_log.WHAT in r.getMessage() for r in caplog.records)


async def test_an_attempt_that_hangs_is_cut_off_and_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that never answers (a broker that accepts and stays silent) counts as a failure once
    :data:`config_log.RECORD_TIMEOUT_S` passes, and the next attempt goes on."""
    monkeypatch.setattr(config_log, "RECORD_TIMEOUT_S", 0.05)
    caplog.set_level(logging.DEBUG, logger="sandbox_lanes.pod")
    calls: list[int] = []

    async def attempt() -> None:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.Event().wait()  # hangs until cut off

    await asyncio.wait_for(config_log.until_recorded(LANE, attempt), 10)
    assert len(calls) == 2
    (error,) = _lines(caplog, STARTED)
    assert "TimeoutError" in error.__dict__["error"]
