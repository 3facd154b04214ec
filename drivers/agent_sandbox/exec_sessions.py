"""Assignment sessions opened ahead: an exec waiting on stdin in each idle warm pod of the pool.

Handing a claimed pod its secrets over a fresh exec costs a websocket to the API server, the API
server's stream to the kubelet, and a process started in the container: about 150 ms on the test
node, most of a warm launch (docs/performance.md). None of that depends on the secrets, so it is
done before the claim: each Ready pod of this installation's pool gets one exec running
``assignment_session_command`` (it reads a length line, then that many bytes, into the assignment
file), which waits on its stdin. When a claim names a pod that has such a session, the delivery
writes the assignment into it and waits for it to exit 0; the secrets travel as before (exec stdin,
TLS to the API server and on to the kubelet), never in an argument or an object.

A session is used once. The refresh (every ``REFRESH_S`` while the pool is in use) opens sessions
for new idle pods and closes those whose pod is gone or claimed, that are older than ``MAX_AGE_S``,
or that the server closed: the client's ``is_open()`` changes only when its stream is read, so each
refresh reads what every idle session's server sent meanwhile (a close frame, or the connection's
end) without waiting. One that is gone between two refreshes fails its write, and the delivery falls
back to a fresh exec.

Nothing here can hold the event loop or the refresh up: every blocking call (the pod list, an open,
the reads, a write, a close, which waits for the server's answer) runs on a thread, each with a
deadline (``drivers.agent_sandbox.exec_connect`` gives the websocket itself one), and the loop awaits
each for a bounded time. A refresh that fails is retried on the one backoff, logged once per outage;
a pod whose session will not open is tried again on a backoff of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from drivers.agent_sandbox.exec_connect import CONNECT_TIMEOUT_S, close_exec
from resilience.backoff import Backoff
from resilience.episode import Episode

#: How often the pool's pods are listed to open (and close) sessions.
REFRESH_S: Final = 1.0
#: A refresh that failed (the API server away) is tried again after REFRESH_S, doubling up to this.
REFRESH_MAX_S: Final = 30.0
#: A pod whose session would not open is tried again after this, doubling up to OPEN_RETRY_MAX_S.
OPEN_RETRY_S: Final = 1.0
OPEN_RETRY_MAX_S: Final = 30.0
#: A session is closed and opened again after this long (well inside the kubelet's 4 h idle timeout).
MAX_AGE_S: Final = 1800.0
#: How long a delivery waits for the session's process to exit once the assignment is written.
EXIT_TIMEOUT_S: Final = 10.0
#: How long closing a session waits for the server to answer its close (on a thread of its own).
CLOSE_TIMEOUT_S: Final = 2.0
#: The most the refresh awaits one blocking step (the list, an open, the reads of the idle sessions):
#: the step's own deadline, plus time for a thread to be free. A step past it is left to end on its
#: own deadline, and what it opens late is closed.
STEP_TIMEOUT_S: Final = 2 * CONNECT_TIMEOUT_S + 5.0
#: Threads for the deliveries' blocking websocket calls, and as many again for the refresh's.
THREADS: Final = 8

T = TypeVar("T")


class Session:
    """One open exec (its websocket client), the pod it runs in, and when it was opened."""

    def __init__(self, pod: str, client: Any, stream: Any) -> None:
        self.pod = pod
        self.client = client  # the ApiClient of its own the exec was opened with
        self.stream = stream
        self.opened = time.monotonic()
        #: Held by whoever reads or writes the stream (a refresh's look, a delivery's write): the
        #: websocket client is not safe for two threads at once.
        self.lock = threading.Lock()

    def is_open(self) -> bool:
        """(Blocking for at most the socket's deadline; not waiting for data) read whatever the server
        sent since: a close frame or the connection's end closes the session. Call with ``lock``."""
        try:
            self.stream.update(timeout=0)
        except Exception:  # the connection lost (websocket-client raises on a read at its end)
            return False
        return bool(self.stream.is_open())

    def looks_open(self) -> bool:
        """A refresh's look: :meth:`is_open`, or True while a delivery holds the session (in use)."""
        if not self.lock.acquire(blocking=False):
            return True
        try:
            return self.is_open()
        finally:
            self.lock.release()

    def close(self) -> None:
        """(Blocking, at most about ``CLOSE_TIMEOUT_S``: never on the event loop.)"""
        close_exec(self.client, self.stream, CLOSE_TIMEOUT_S)


def feed_and_wait(resp: Any, data: bytes, timeout_s: float) -> int | None:
    """(Blocking) write ``data`` into an exec's stdin and wait for it to end: its exit code, or None
    (it did not end within ``timeout_s``). A fresh exec and a session opened ahead both end here."""
    resp.write_stdin(data)
    deadline = time.monotonic() + timeout_s
    while resp.is_open() and (left := deadline - time.monotonic()) > 0:
        resp.update(timeout=min(1.0, left))
    code: int | None = resp.returncode
    return code


def write_and_wait(session: Session, payload: bytes) -> int | None:
    """(Blocking) write ``payload`` into the session's stdin; its process's exit code, or None (the
    session was closed meanwhile: nothing written). The session is closed after."""
    try:
        with session.lock:
            if not session.is_open():
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
        *,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        self._open_session = open_session  # blocking, with a deadline: opens an exec in the pod
        self._idle_pods = idle_pods  # blocking, with a deadline: this installation's idle Ready pool pods
        self._logger = logger
        self._limit = limit
        self._step_timeout_s = step_timeout_s
        self._sessions: dict[str, Session] = {}
        self._opening: set[str] = set()
        #: Pods whose last open failed: the backoff, and the earliest time of the next try.
        self._open_retry: dict[str, tuple[Backoff, float]] = {}
        #: The deliveries' writes and fresh execs; the refresh's list, opens and reads have threads of
        #: their own, and so do closes (each waits for the server's answer), so none holds another up.
        pool = concurrent.futures.ThreadPoolExecutor
        self.executor = pool(THREADS, thread_name_prefix="agent-sandbox-exec")
        self._opener = pool(THREADS, thread_name_prefix="agent-sandbox-open")
        self._closer = pool(2, thread_name_prefix="agent-sandbox-close")
        self._task: asyncio.Task[None] | None = None
        self.retry = Episode(
            "agent-sandbox exec sessions' refresh (deliveries exec afresh meanwhile)",
            logger,
            first_delay_s=REFRESH_S,
            max_delay_s=REFRESH_MAX_S,
        )

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep(), name="agent-sandbox-exec-sessions")

    def take(self, pod: str) -> Session | None:
        """The open session in ``pod`` (it leaves the set: a session is used once), or None."""
        return self._sessions.pop(pod, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def close_later(self, session: Session) -> None:
        """Close ``session`` on a closing thread (it waits for the server's answer: never on the loop)."""
        try:
            self._closer.submit(session.close)
        except RuntimeError:  # shut down already (the pool closing): a thread of its own, then
            threading.Thread(target=session.close, name="agent-sandbox-close", daemon=True).start()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            self.close_later(session)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._opener.shutdown(wait=False, cancel_futures=True)
        self._closer.shutdown(wait=False)  # the closes submitted still run (each bounded)

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.refresh(loop)
                self.retry.recovered()
                delay = REFRESH_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server away: deliveries use fresh execs meanwhile
                delay = self.retry.failed(exc)
            await asyncio.sleep(delay)

    async def _off_loop(self, executor: concurrent.futures.Executor, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread of ``executor``, awaited for at most the step timeout."""
        future = executor.submit(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self._step_timeout_s)
        except TimeoutError:
            future.cancel()  # not started yet (no thread free): never started
            raise

    async def refresh(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Close the sessions of pods no longer idle, too old, or closed by the server; open one in each
        new idle pod (those whose last open failed once their backoff has passed)."""
        idle = set(await self._off_loop(self._opener, self._idle_pods))
        now = time.monotonic()
        for pod, session in list(self._sessions.items()):
            if pod not in idle or now - session.opened > MAX_AGE_S:
                del self._sessions[pod]
                self.close_later(session)
        looked_at = list(self._sessions.values())
        closed = (
            await self._off_loop(self._opener, lambda: [s for s in looked_at if not s.looks_open()])
            if looked_at
            else []
        )
        for session in closed:
            if self._sessions.get(session.pod) is session:
                del self._sessions[session.pod]
            self.close_later(session)
        for pod in [p for p in self._open_retry if p not in idle]:
            del self._open_retry[pod]
        wanted = [
            p
            for p in sorted(idle)
            if p not in self._sessions
            and p not in self._opening
            and (p not in self._open_retry or self._open_retry[p][1] <= now)
        ]
        room = max(0, self._limit - len(self._sessions) - len(self._opening))
        await asyncio.gather(*(self._open(pod) for pod in wanted[:room]))

    async def _open(self, pod: str) -> None:
        self._opening.add(pod)
        future = self._opener.submit(self._open_session, pod)
        try:
            session = await asyncio.wait_for(asyncio.wrap_future(future), self._step_timeout_s)
        except asyncio.CancelledError:  # the pool closing: what the open still brings is closed
            if not future.cancel():
                future.add_done_callback(self._close_late_open)
            raise
        except Exception as exc:  # not ready for an exec yet, gone, or past its deadline
            if not future.cancel():
                future.add_done_callback(self._close_late_open)
            fresh = (Backoff(first_s=OPEN_RETRY_S, cap_s=OPEN_RETRY_MAX_S), 0.0)
            backoff = self._open_retry.get(pod, fresh)[0]
            self._open_retry[pod] = (backoff, time.monotonic() + backoff.failed())
            error = f"{type(exc).__name__}: {exc}"[:300]
            self._logger.debug(
                "agent-sandbox exec session not opened",
                extra={"pod": pod, "error": error, "attempts": backoff.in_a_row},
            )
            return
        finally:
            self._opening.discard(pod)
        self._open_retry.pop(pod, None)
        old = self._sessions.pop(pod, None)
        if old is not None:
            self.close_later(old)
        self._sessions[pod] = session

    def _close_late_open(self, future: concurrent.futures.Future[Session]) -> None:
        """(On the opening thread) a session that opened after its open was given up: closed."""
        if not future.cancelled() and future.exception() is None:
            self.close_later(future.result())
