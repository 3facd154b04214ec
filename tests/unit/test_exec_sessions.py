"""The bookkeeping of the assignment sessions opened ahead (``drivers.agent_sandbox.exec_sessions``),
with stand-in streams. The real path (a session in a pool pod of the node, written by a delivery) is
tests/integration/test_agent_sandbox_driver.py's async warm test."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from drivers.agent_sandbox.exec_sessions import ExecSessions, Session, write_and_wait
from drivers.agent_sandbox.warm import assignment_session_payload


class _Stream:
    def __init__(self, exit_code: int = 0) -> None:
        self.open = True
        self.written = b""
        self.returncode: int | None = None
        self.closed = False
        self._exit_code = exit_code

    def is_open(self) -> bool:
        return self.open

    def write_stdin(self, data: bytes) -> None:
        self.written += data

    def update(self, timeout: float) -> None:
        self.returncode, self.open = self._exit_code, False  # the process read it all and exited

    def close(self) -> None:
        self.closed, self.open = True, False


class _Client:
    closed = False

    def close(self) -> None:
        self.closed = True


def _sessions(idle: list[str], limit: int = 5) -> tuple[ExecSessions, dict[str, list[_Stream]]]:
    opened: dict[str, list[_Stream]] = {}

    def open_session(pod: str) -> Session:
        stream = _Stream()
        opened.setdefault(pod, []).append(stream)
        return Session(pod, _Client(), stream)

    return ExecSessions(open_session, lambda: list(idle), logging.getLogger("test"), limit), opened


def test_a_refresh_opens_one_session_per_idle_pod_up_to_the_limit_and_a_session_is_taken_once() -> None:
    async def run() -> None:
        idle = ["p1", "p2", "p3"]
        sessions, opened = _sessions(idle, limit=2)
        loop = asyncio.get_running_loop()
        await sessions.refresh(loop)
        assert len(sessions) == 2 and set(opened) == {"p1", "p2"}
        await sessions.refresh(loop)
        assert sum(len(s) for s in opened.values()) == 2  # none opened twice
        taken = sessions.take("p1")
        assert taken is not None and taken.pod == "p1"
        assert sessions.take("p1") is None  # used once
        idle.remove("p1")  # claimed: no longer idle
        await sessions.refresh(loop)
        assert set(opened) == {"p1", "p2", "p3"} and len(sessions) == 2  # room again: p3
        await sessions.close()

    asyncio.run(run())


def test_a_refresh_closes_the_sessions_of_pods_no_longer_idle_and_of_closed_streams() -> None:
    async def run() -> None:
        idle = ["p1", "p2"]
        sessions, opened = _sessions(idle)
        loop = asyncio.get_running_loop()
        await sessions.refresh(loop)
        idle.remove("p1")  # claimed (or gone)
        opened["p2"][0].open = False  # its stream closed under it (an idle timeout)
        await sessions.refresh(loop)
        assert opened["p1"][0].closed and sessions.take("p1") is None
        assert len(opened["p2"]) == 2 and sessions.take("p2") is not None  # opened again
        await sessions.close()
        assert all(s.closed for streams in opened.values() for s in streams if s is not opened["p2"][1])

    asyncio.run(run())


def test_writing_a_session_gives_its_exit_code_and_closes_it() -> None:
    data = b"# stigmer sandbox assignment\nSTIGMER_TOKEN=tok\n"
    stream, client = _Stream(), _Client()
    assert write_and_wait(Session("p1", client, stream), assignment_session_payload(data)) == 0
    assert stream.written == f"{len(data)}\n".encode() + data
    assert stream.closed and client.closed
    failed = _Stream(exit_code=1)
    assert write_and_wait(Session("p2", _Client(), failed), b"x") == 1
    gone = _Stream()
    gone.open = False
    assert write_and_wait(Session("p3", _Client(), gone), b"x") is None  # nothing written to it
    assert gone.written == b""


def test_the_session_command_reads_the_length_line_then_exactly_that_many_bytes(tmp_path: Any) -> None:
    import subprocess

    from drivers.agent_sandbox.warm import ASSIGNMENT_FILE, assignment_session_command

    target = tmp_path / "assignment.env"
    # (the wake goes to PID 1 of the pod's container; here it would reach the host's init: not sent)
    command = [
        part.replace(ASSIGNMENT_FILE, str(target)).replace("kill -WINCH 1", ":")
        for part in assignment_session_command()
    ]
    assert command != assignment_session_command()
    command[0] = "/bin/busybox"
    command.insert(1, "sh")
    data = b"# stigmer sandbox assignment\nSTIGMER_TOKEN='a\nb'\n"
    subprocess.run(command, input=assignment_session_payload(data) + b"trailing", check=True, timeout=10)
    assert target.read_bytes() == data
    assert oct(target.stat().st_mode & 0o777) == "0o600"
