"""The assignment sessions opened ahead (``drivers.agent_sandbox.exec_sessions``) on the real client.

Every session here is a real exec: the real kubernetes client (``stream()``, its ``WSClient``, the
driver's ``open_exec``) over a real websocket on 127.0.0.1 to ``tests.support.exec_server``, which
speaks the Kubernetes channel protocol and runs the real session command as a process. What the
server does to a session (closes it while idle, never answers an open, holds its answer to a close)
is what an API server and kubelet do; the verdicts are facts the server or the client recorded. The
same path on a real API server and kubelet: tests/integration/test_agent_sandbox_driver.py's async
warm test on the node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from drivers.agent_sandbox.exec_connect import open_exec
from drivers.agent_sandbox.exec_sessions import ExecSessions, Session, write_and_wait
from drivers.agent_sandbox.warm import ASSIGNMENT_FILE, assignment_session_command, assignment_session_payload
from tests.support.exec_server import ExecServer

DATA = b"# stigmer sandbox assignment\nSTIGMER_TASK_QUEUE=q\nSTIGMER_TOKEN='tok'\n"


@pytest.fixture
def server(tmp_path: Any) -> Iterator[ExecServer]:
    def rewrite(pod: str, command: list[str]) -> list[str]:
        (tmp_path / pod).mkdir(exist_ok=True)
        moved = [
            part.replace(ASSIGNMENT_FILE, str(tmp_path / pod / "assignment.env")).replace(
                "kill -WINCH 1", ":"
            )
            for part in command
        ]
        assert not any("kill -" in part for part in moved)  # never a signal to this machine's PID 1
        return moved

    exec_server = ExecServer(rewrite).start()
    try:
        yield exec_server
    finally:
        exec_server.stop()


class _Pool:
    """An ExecSessions on ``server`` over the idle pods ``idle``, with every session it opened."""

    def __init__(
        self, server: ExecServer, idle: list[str], limit: int = 5, connect_timeout_s: float = 5.0
    ) -> None:
        self.idle = idle
        self.opened: dict[str, list[Session]] = {}
        configuration = server.configuration()

        def open_session(pod: str) -> Session:
            client, stream = open_exec(
                configuration, pod, "ns", "runner", assignment_session_command(), timeout_s=connect_timeout_s
            )
            session = Session(pod, client, stream)
            self.opened.setdefault(pod, []).append(session)
            return session

        self.sessions = ExecSessions(
            open_session, lambda: list(self.idle), logging.getLogger("test.exec_sessions"), limit
        )


def _written(tmp_path: Any, pod: str) -> bytes:
    path = tmp_path / pod / "assignment.env"
    return path.read_bytes() if path.exists() else b""


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def test_a_refresh_opens_one_real_session_per_idle_pod_up_to_the_limit_and_a_session_is_taken_once(
    server: ExecServer, tmp_path: Any
) -> None:
    async def run() -> None:
        pool = _Pool(server, ["p1", "p2", "p3"], limit=2)
        sessions = pool.sessions
        await sessions.refresh()
        assert len(sessions) == 2 and set(pool.opened) == {"p1", "p2"}
        assert [len(server.of(p)) for p in ("p1", "p2", "p3")] == [1, 1, 0]
        assert all(ex.upgraded and not ex.ended for p in ("p1", "p2") for ex in server.of(p))
        await sessions.refresh()
        assert [len(server.of(p)) for p in ("p1", "p2", "p3")] == [1, 1, 0]  # none opened twice
        taken = sessions.take("p1")
        assert taken is not None and taken.pod == "p1"
        assert sessions.take("p1") is None  # used once
        pool.idle.remove("p1")  # claimed: no longer idle
        await sessions.refresh()
        assert len(server.of("p3")) == 1 and len(sessions) == 2  # room again: p3
        # The session taken is a live exec: the assignment written into it lands in the pod's file.
        assert await _in_thread(write_and_wait, taken, assignment_session_payload(DATA)) == 0
        assert _written(tmp_path, "p1") == DATA
        await sessions.close()
        every = ["p1", "p2", "p3"]
        await _in_thread(
            server.wait_for, "every exec over", lambda: all(e.ended for p in every for e in server.of(p))
        )

    asyncio.run(run())


@pytest.mark.parametrize("close_frame", [True, False], ids=["close-frame", "connection-cut"])
def test_a_session_its_server_closed_while_idle_is_noticed_and_opened_again(
    server: ExecServer, tmp_path: Any, close_frame: bool
) -> None:
    """The kubelet's idle timeout, or the pod's exec gone: nothing reads an idle session, so the
    client's ``is_open()`` would say True for ever; the refresh reads what the server sent."""

    async def run() -> None:
        pool = _Pool(server, ["p1", "p2"])
        sessions = pool.sessions
        await sessions.refresh()
        first = pool.opened["p1"][0]
        await _in_thread(server.drop, "p1", close_frame)  # returns once closed on the server's side
        assert first.stream.is_open()  # what the client says until its stream is read
        await sessions.refresh()
        assert len(server.of("p1")) == 2, "the closed session was kept: never opened again"
        assert len(server.of("p2")) == 1  # the open one left alone
        session = sessions.take("p1")
        assert session is not None and session is not first
        assert await _in_thread(write_and_wait, session, assignment_session_payload(DATA)) == 0
        assert _written(tmp_path, "p1") == DATA
        await sessions.close()

    asyncio.run(run())


def test_a_session_closed_after_it_was_taken_writes_nothing_and_says_so(
    server: ExecServer, tmp_path: Any
) -> None:
    async def run() -> None:
        pool = _Pool(server, ["p1"])
        await pool.sessions.refresh()
        session = pool.sessions.take("p1")
        assert session is not None
        await _in_thread(server.drop, "p1", True)
        assert await _in_thread(write_and_wait, session, assignment_session_payload(DATA)) is None
        assert server.of("p1")[0].stdin == b"" and _written(tmp_path, "p1") == b""  # the fresh exec's job
        await pool.sessions.close()

    asyncio.run(run())


def test_writing_a_session_gives_the_exit_code_of_its_real_process(server: ExecServer, tmp_path: Any) -> None:
    async def run() -> None:
        pool = _Pool(server, ["p1", "p2"])
        await pool.sessions.refresh()
        ok, bad = pool.sessions.take("p1"), pool.sessions.take("p2")
        assert ok is not None and bad is not None
        assert await _in_thread(write_and_wait, ok, assignment_session_payload(DATA)) == 0
        assert _written(tmp_path, "p1") == DATA
        assert server.of("p1")[0].stdin == assignment_session_payload(DATA)
        # A length line that is no length: the session's head fails, and its exit code comes back.
        code = await _in_thread(write_and_wait, bad, b"many\n" + DATA)
        assert code is not None and code != 0 and code == server.of("p2")[0].exit_code
        assert _written(tmp_path, "p2") == b""
        await pool.sessions.close()

    asyncio.run(run())


def test_an_open_that_is_never_answered_is_given_up_and_holds_no_other_pod_up(server: ExecServer) -> None:
    """An API server that takes the connection and never answers the upgrade (waiting on a kubelet
    that does not answer): the open gives up at its deadline, the refresh goes on, and the thread is
    free again (the server sees the client leave)."""
    server.hang.add("p1")

    async def run() -> None:
        pool = _Pool(server, ["p1", "p2"], connect_timeout_s=0.5)
        sessions = pool.sessions
        began = time.monotonic()
        await asyncio.wait_for(sessions.refresh(), 60)  # (without a deadline the open never returns)
        took = time.monotonic() - began
        assert "p1" not in pool.opened and len(pool.opened["p2"]) == 1 and len(sessions) == 1
        await _in_thread(
            server.wait_for, "the client left the unanswered open", lambda: server.of("p1")[0].ended
        )
        await sessions.refresh()  # at once: p1's next try waits for its backoff
        assert len(server.of("p1")) == 1
        await sessions.close()
        print(f"\nrefresh with one open never answered: {took:.2f} s (connect deadline 0.5 s)")

    asyncio.run(run())


def test_a_fresh_exec_whose_open_is_never_answered_gives_up_at_its_deadline(server: ExecServer) -> None:
    server.hang.add("p1")

    def fresh() -> Any:
        return open_exec(server.configuration(), "p1", "ns", "runner", ["/bin/true"], timeout_s=0.5)

    async def run() -> None:
        with pytest.raises(Exception, match="timed out"):
            await asyncio.wait_for(asyncio.to_thread(fresh), 60)
        await _in_thread(server.wait_for, "the client left", lambda: server.of("p1")[0].ended)

    asyncio.run(run())


def test_closing_a_session_never_holds_the_event_loop(server: ExecServer) -> None:
    """A close waits for the server's answer (3 s by default in the client). The server here answers
    only once this test, on the event loop, has seen the close frame and lets it: a close that ran on
    the loop would give up unanswered before the test could let the server answer."""
    server.hold_close.add("p1")

    async def run() -> None:
        pool = _Pool(server, ["p1"])
        sessions = pool.sessions
        await sessions.refresh()
        session = pool.opened["p1"][0]
        pool.idle.clear()  # claimed: the next refresh closes its session
        refresh = asyncio.create_task(sessions.refresh())
        await _in_thread(
            server.wait_for, "the client's close frame", lambda: server.of("p1")[0].client_closed
        )
        server.release_close("p1")
        await refresh
        await _in_thread(server.wait_for, "the close answered", lambda: server.of("p1")[0].close_answered)
        deadline = time.monotonic() + 20
        while session.stream.sock is not None and session.stream.sock.close_frame is None:
            assert time.monotonic() < deadline, "the client's close never got the server's answer"
            await asyncio.sleep(0.01)
        await sessions.close()

    asyncio.run(run())


def test_a_refresh_that_keeps_failing_is_retried_on_the_backoff_and_logged_once(
    server: ExecServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The API server away for 200 refreshes in a row (its pod list fails), then back: the refresh loop
    goes on, one ERROR line for the outage, and the sessions are opened once it answers."""
    from resilience.episode import Episode

    calls = {"n": 0}

    def idle_pods() -> list[str]:
        calls["n"] += 1
        if calls["n"] <= 200:
            raise ConnectionRefusedError("the API server is away")
        return ["p1"]

    logger = logging.getLogger("test.exec_sessions.outage")

    async def run() -> None:
        pool = _Pool(server, [])
        sessions = ExecSessions(pool.sessions._open_session, idle_pods, logger, 2)
        # the loop's own backoff, its pauses made short so that 200 failures take a moment
        sessions.retry = Episode("exec sessions' refresh", logger, first_delay_s=0.001, max_delay_s=0.002)
        with caplog.at_level(logging.DEBUG, logger=logger.name):
            sessions.start()
            await _in_thread(server.wait_for, "a session after the outage", lambda: bool(server.of("p1")))
            deadline = time.monotonic() + 20
            while len(sessions) != 1:
                assert time.monotonic() < deadline, "no session after the outage"
                await asyncio.sleep(0.01)
            await sessions.close()
        records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger.name]
        errors = [m for level, m in records if level >= logging.ERROR]
        assert errors == ["exec sessions' refresh failed; retrying with backoff until it succeeds"]
        assert sum(1 for level, _ in records if level == logging.DEBUG) == 199  # the others, quiet

    asyncio.run(run())


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
