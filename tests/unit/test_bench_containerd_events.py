"""The private node's cold-launch steps keep their labels after containerd removes the containers.

The bench asks for the marks once the burst is over and its sandboxes are torn down; by then the
kubelet may have removed the runners' containers, and a label lookup then finds nothing (CI at stop 52:
2 of 3 cold creates lost their container steps). A stand-in ``ctr`` on ``PATH`` plays containerd's
two answers — its event stream, and ``containers info`` until a container is removed — below the
real node's run in ``tests/integration/test_bench_smoke.py``.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest
from sandbox_lanes_bench.containerd_events import ContainerdEvents

FAKE_CTR = """#!{python}
import json, os, sys, time
state = {state!r}
args = sys.argv[1:]
if "events" in args:
    for line in open(os.path.join(state, "events")):
        print(line.rstrip("\\n"), flush=True)
    time.sleep(30)
    sys.exit(0)
container = args[-1]
if os.path.exists(os.path.join(state, "removed")):
    sys.exit(1)
kinds = {{"pause1": "sandbox", "run1": "container"}}
print(json.dumps({{"Labels": {{"io.kubernetes.pod.name": "runner-a", "io.cri-containerd.kind": kinds[container]}}}}))
"""

EVENTS = [
    '2026-12-05 13:27:55.100000000 +0000 UTC k8s.io /tasks/start {"container_id":"pause1"}',
    '2026-12-05 13:27:55.200000000 +0000 UTC k8s.io /containers/create {"id":"run1"}',
    '2026-12-05 13:27:55.300000000 +0000 UTC k8s.io /tasks/start {"container_id":"run1"}',
    '2026-12-05 13:27:55.400000000 +0000 UTC moby /tasks/start {"container_id":"other"}',
]


def test_marks_outlive_the_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ctr = bin_dir / "ctr"
    ctr.write_text(FAKE_CTR.format(python=sys.executable, state=str(tmp_path)))
    ctr.chmod(ctr.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "events").write_text("\n".join(EVENTS) + "\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    with ContainerdEvents(tmp_path / "containerd.sock") as events:
        deadline = time.monotonic() + 30
        while (len(events.labels) < 2 or len(events.seen) < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
    (tmp_path / "removed").touch()  # the burst's teardown: containerd no longer knows them

    offset = 1_796_000_000.0
    marks = events.marks({"runner-a": "sandbox-1"}, offset)
    assert set(marks) == {"sandbox-1"}, marks
    steps = marks["sandbox-1"]
    assert set(steps) == {"sandbox_started", "container_created", "container_started"}, steps
    assert steps["container_created"] - steps["sandbox_started"] == pytest.approx(0.1, abs=1e-6)
    assert steps["container_started"] - steps["container_created"] == pytest.approx(0.1, abs=1e-6)
