"""The harness's engine leaves nothing behind: no process, no mount, no directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.dockerd import Dockerd

pytestmark = [pytest.mark.docker]


def test_a_stopped_engine_leaves_no_mount_and_no_root_behind() -> None:
    engine = Dockerd()
    engine.start()
    root = Path(engine.root).resolve()
    pid = engine.pid()
    mounted = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert any(p.startswith(str(root)) for p in mounted)  # dockerd bind-mounts its default netns
    engine.stop()
    mounted = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert [p for p in mounted if p.startswith(str(root))] == []
    assert not root.exists()
    assert pid is not None and not Path(f"/proc/{pid}").exists()
