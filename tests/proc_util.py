"""Find real runner processes through /proc (what the kernel says, not what a driver believes)."""

from __future__ import annotations

from pathlib import Path


def runner_pids(task_queue: str) -> list[int]:
    """Live (non-zombie) processes whose environment has ``STIGMER_TASK_QUEUE=<task_queue>``."""
    needle = f"STIGMER_TASK_QUEUE={task_queue}".encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state = stat.rsplit(")", 1)[-1].split()[0]
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def processes_under(root: Path) -> list[int]:
    """Live processes whose ``WORKSPACE_ROOT_DIR`` lies under ``root`` (a test's own sandboxes)."""
    prefix = f"WORKSPACE_ROOT_DIR={root}".encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] != "Z" and any(v.startswith(prefix) for v in environ.split(b"\0")):
            found.append(int(entry.name))
    return sorted(found)
