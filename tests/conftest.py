"""Shared pytest wiring: the real parts (Kafka, dockerd, kube-apiserver) are session fixtures."""

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pod_harness import PodProcess
from tests.support.proc_util import processes_under

pytest_plugins = [
    "tests.support.fixtures.kafka",
    "tests.support.fixtures.dockerd",
    "tests.support.fixtures.kube",
    "tests.support.fixtures.agent_sandbox",
    "tests.support.fixtures.toxiproxy",
    "tests.support.fixtures.release",
    "tests.support.fixtures.pods",
    "tests.support.fixtures.stores",
]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under the README's test command a skipped test fails the run: a skip is never a pass."""
    if os.environ.get("SANDBOX_LANES_FORBID_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped:
        reporter.write_line(f"{skipped} test(s) skipped: skips are failures under scripts/test.sh", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def no_leaked_runners(tmp_path: Path) -> Iterator[None]:
    """Every pod and runner a test starts is gone when it ends; a leaked runner fails the test."""
    yield
    PodProcess.kill_all()
    leaked = processes_under(tmp_path)
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert leaked == [], f"runner processes leaked: {leaked}"
