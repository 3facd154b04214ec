"""The chaos run (tests/support/chaos.py) at a reduced size: kill -9, a broker restart, a rebalance window,
duplicated / reordered input and failing drivers, on real Kafka; every invariant must hold.

The broker-restart run uses its own KafkaBroker (the session fixture's broker is shared with every
other test and is never restarted); the others run on the fixture's broker. The broker-restart run's
pods keep their states on disk (``SANDBOX_LANES_STATE_STORE=rocksdb``, a state directory per pod id
kept across its kills, as a StatefulSet's volume): restarts resume from their checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.chaos import ChaosOptions, run_chaos
from tests.support.pod_harness import PodProcess
from tests.support.proc_util import processes_under

pytestmark = pytest.mark.kafka


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    PodProcess.kill_all()
    for pid in processes_under(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _chaos(opts: ChaosOptions) -> list[str]:
    lines: list[str] = []
    opts.out = lines.append
    opts.show_progress = False
    results = await run_chaos(opts)
    text = "\n".join(lines)
    assert results and all(r.ok for r in results), text
    assert lines[-1] == "ALL-RECORDS-DELIVERED", text
    return lines


@pytest.mark.timeout(420)
async def test_chaos_memory_driver_with_kills_a_broker_restart_and_a_rebalance_on_the_disk_store(
    tmp_path: Path,
) -> None:
    lines = await _chaos(
        ChaosOptions(
            executions=300,
            kills=2,
            driver="memory",
            seed=7,
            guarantees=("exactly_once",),
            bootstrap=None,  # its own broker: this one is restarted
            broker_restarts=1,
            rebalance_windows=1,
            latency_ms=2000,  # calls take 0-2 s: in flight across kills, the broker restart, rebalances
            hang_rate=0.01,  # and 1 % hang until the ensure/teardown timeout
            state_store="rocksdb",
            work_dir=tmp_path,
        )
    )
    figures = _figures(lines)
    assert figures["kills"] == 2 and figures["broker restarts"] == 1, figures
    # The premise: the pods' states were on disk, and restarts after the kills resumed from checkpoints.
    restores = [
        json.loads(line)
        for log in sorted(tmp_path.rglob("pod-*.log"))
        for line in log.read_text().splitlines()
        if '"state restored"' in line
    ]
    assert any(r["fromCheckpoint"] > 0 for r in restores), restores
    assert figures["duplicates injected"] > 0 and figures["injected duplicates ignored"] > 0, figures
    # exactly_once: an input is ignored as a duplicate only when it was injected twice.
    assert figures["inputs redelivered after a kill and ignored"] == 0, figures
    assert figures["recovers"] > 0 and figures["stale"] > 0, figures


def _figures(lines: list[str], nth: int = 0) -> dict[str, int]:
    """The numeric figures of the nth run's ``figures:`` line."""
    line = [x for x in lines if x.startswith("  figures: ")][nth].removeprefix("  figures: ")
    return {k: int(v) for k, v in re.findall(r"(?:^|, )([^=]+?)=(-?\d+)(?=, |$)", line)}


@pytest.mark.timeout(300)
async def test_chaos_at_least_once_reports_same_id_redeliveries(kafka_bootstrap: str, tmp_path: Path) -> None:
    lines = await _chaos(
        ChaosOptions(
            executions=200,
            kills=2,
            driver="memory",
            seed=11,
            guarantees=("at_least_once",),
            bootstrap=kafka_bootstrap,
            broker_restarts=0,
            rebalance_windows=1,
            latency_ms=2000,
            hang_rate=0.01,
            work_dir=tmp_path,
        )
    )
    figures = _figures(lines)
    assert figures["kills"] == 2, figures
    # Counted, never assumed: the injected same-id inputs were each ignored (the count is not zero),
    # and same-id outcome copies are identical records (a verdict line); their number is reported.
    assert figures["duplicates injected"] > 0 and figures["injected duplicates ignored"] > 0, figures
    assert "same-id redeliveries" in figures and "inputs redelivered after a kill and ignored" in figures


@pytest.mark.timeout(300)
async def test_chaos_local_process_driver_with_real_runners_and_the_reaper(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    lines = await _chaos(
        ChaosOptions(
            executions=80,
            kills=1,
            driver="local-process",
            seed=3,
            guarantees=("exactly_once",),
            bootstrap=kafka_bootstrap,
            broker_restarts=0,
            rebalance_windows=1,
            ensure_failure_rate=0.08,
            teardown_failure_rate=0.08,
            work_dir=tmp_path,
        )
    )
    assert any("no sandbox alive for a terminal execution once the reaper ran" in line for line in lines)
    figures = _figures(lines)
    # Teardown failures were injected: runners were left behind and the reaper removed them.
    assert figures["leaked before the reaper"] > 0 and figures["reaper removed"] > 0, figures
    assert processes_under(tmp_path) == []
