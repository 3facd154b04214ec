"""Assignment sessions opened ahead: an exec waiting on stdin in each idle warm pod of the pool.

Handing a claimed pod its secrets over a fresh exec costs a websocket to the API server, the API
server's stream to the kubelet, and a process started in the container: about 150 ms on the test
node, most of a warm launch (docs/performance.md). None of that depends on the secrets, so it is
done before the claim: each Ready pod of this installation's pool gets one exec running
``assignment_session_command`` (it reads a length line, then that many bytes, into the assignment
file), which waits on its stdin. When a claim names a pod that has such a session, the delivery
writes the assignment into it and waits for it to exit 0; the secrets travel as before (exec stdin,
TLS to the API server and on to the kubelet), never in an argument or an object.

A session is used once. One that is gone (its pod deleted, a stream closed by the API server or the
kubelet after an idle timeout) fails its write, and the delivery falls back to a fresh exec. The
refresh (every ``REFRESH_S`` while the pool is in use) opens sessions for new idle pods and closes
those whose pod is gone or claimed, or that are older than ``MAX_AGE_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

#: How often the pool's pods are listed to open (and close) sessions.
REFRESH_S: Final = 1.0
#: A session is closed and opened again after this long (well inside the kubelet's 4 h idle timeout).
MAX_AGE_S: Final = 1800.0
#: How long a delivery waits for the session's process to exit once the assignment is written.
EXIT_TIMEOUT_S: Final = 10.0
#: Threads for the deliveries' blocking websocket calls, and as many again for the refresh's.
THREADS: Final = 8


class Session:
    """One open exec (its websocket client), the pod it runs in, and when it was opened."""

    def __init__(self, pod: str, client: Any, stream: Any) -> None:
        self.pod = pod
        self.client = client  # the ApiClient of its own the exec was opened with
        self.stream = stream
        self.opened = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        with contextlib.suppress(Exception):
            self.client.close()


def feed_and_wait(resp: Any, data: bytes, timeout_s: float) -> int | None:
    """(Blocking) write ``data`` into an exec's stdin and wait for it to end: its exit code, or None
    (it did not end within ``timeout_s``). A fresh exec and a session opened ahead both end here."""
    resp.write_stdin(data)
    deadline = time.monotonic() + timeout_s
    while resp.is_open() and time.monotonic() < deadline:
        resp.update(timeout=1)
    code: int | None = resp.returncode
    return code


def write_and_wait(session: Session, payload: bytes) -> int | None:
    """(Blocking) write ``payload`` into the session's stdin; its process's exit code, or None."""
    try:
        if not session.stream.is_open():
            return None
        return feed_and_wait(session.stream, payload, EXIT_TIMEOUT_S)
    finally:
        session.close()


class ExecSessions:
    """The open sessions by pod name, kept in step with the pool's idle pods."""

    def __init__(
        self,
        open_session: Callable[[str], Session],
        idle_pods: Callable[[], list[str]],
        logger: logging.Logger,
        limit: int,
    ) -> None:
        self._open_session = open_session  # blocking: opens an exec in the pod
        self._idle_pods = idle_pods  # blocking: this installation's idle Ready pool pods
        self._logger = logger
        self._limit = limit
        self._sessions: dict[str, Session] = {}
        self._opening: set[str] = set()
        #: The deliveries' writes and fresh execs; the refresh's list and opens have threads of their
        #: own, so an open that hangs (a websocket connect has no timeout) never holds a delivery up.
        self.executor = concurrent.futures.ThreadPoolExecutor(
            THREADS, thread_name_prefix="agent-sandbox-exec"
        )
        self._opener = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="agent-sandbox-open")
        self._task: asyncio.Task[None] | None = None
        self._failures = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep(), name="agent-sandbox-exec-sessions")

    def take(self, pod: str) -> Session | None:
        """The open session in ``pod`` (it leaves the set: a session is used once), or None."""
        return self._sessions.pop(pod, None)

    def __len__(self) -> int:
        return len(self._sessions)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._opener.shutdown(wait=False, cancel_futures=True)

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.refresh(loop)
                if self._failures:
                    self._logger.info(
                        "agent-sandbox exec sessions recovered", extra={"failures": self._failures}
                    )
                    self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server away: deliveries use fresh execs meanwhile
                self._failures += 1
                if self._failures == 1:
                    self._logger.warning(
                        "agent-sandbox exec sessions not refreshed; deliveries exec afresh meanwhile",
                        extra={"error": f"{type(exc).__name__}: {exc}"[:500]},
                    )
            await asyncio.sleep(REFRESH_S)

    async def refresh(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close the sessions of pods no longer idle (or too old); open one in each new idle pod."""
        idle = await loop.run_in_executor(self._opener, self._idle_pods)
        now = time.monotonic()
        for pod, session in list(self._sessions.items()):
            if pod not in idle or now - session.opened > MAX_AGE_S or not session.stream.is_open():
                del self._sessions[pod]
                session.close()
        wanted = [p for p in idle if p not in self._sessions and p not in self._opening]
        room = max(0, self._limit - len(self._sessions) - len(self._opening))
        await asyncio.gather(*(self._open(loop, pod) for pod in wanted[:room]))

    async def _open(self, loop: asyncio.AbstractEventLoop, pod: str) -> None:
        self._opening.add(pod)
        try:
            session = await loop.run_in_executor(self._opener, self._open_session, pod)
        except Exception as exc:  # not ready for an exec yet, or gone: the next refresh tries again
            self._logger.debug("agent-sandbox exec session not opened", extra={"pod": pod, "error": str(exc)})
            return
        finally:
            self._opening.discard(pod)
        old = self._sessions.pop(pod, None)
        if old is not None:
            old.close()
        self._sessions[pod] = session
