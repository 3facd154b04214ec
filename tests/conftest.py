"""Shared pytest wiring: the real parts (Kafka, dockerd, kube-apiserver) are session fixtures."""

import os

import pytest

pytest_plugins = [
    "tests.fixtures.kafka",
    "tests.fixtures.dockerd",
    "tests.fixtures.kube",
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
