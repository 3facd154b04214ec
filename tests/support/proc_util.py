"""Find real runner processes through /proc (what the kernel says, not what a driver believes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def _live_environments() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment entries) of every live, non-zombie process we may read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] != "Z":
            yield int(entry.name), environ.split(b"\0")


def runner_pids(task_queue: str) -> list[int]:
    """Live processes whose environment has ``STIGMER_TASK_QUEUE=<task_queue>``."""
    needle = f"STIGMER_TASK_QUEUE={task_queue}".encode()
    return sorted(pid for pid, env in _live_environments() if needle in env)


def processes_under(root: Path) -> list[int]:
    """Live processes whose ``WORKSPACE_ROOT_DIR`` lies under ``root`` (a test's own sandboxes)."""
    prefix = f"WORKSPACE_ROOT_DIR={root}".encode()
    return sorted(pid for pid, env in _live_environments() if any(v.startswith(prefix) for v in env))
