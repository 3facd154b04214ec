"""A pod exec endpoint on 127.0.0.1: the API server's ``pods/{pod}/exec`` and the kubelet behind it.

A real websocket server (aiohttp) speaking the Kubernetes channel protocol (``v5.channel.k8s.io``,
``v4.channel.k8s.io``: a channel byte before each frame's data; 0 stdin, 1 stdout, 2 stderr, 3 the
exit status as a ``metav1.Status``; v5's 255 closes a channel), each exec a real process running the
command the client asked for (through ``rewrite``: a test moves paths under its tmp dir). So
the real kubernetes client (``stream()``, ``WSClient``) and all the driver does with it run as they
do against a cluster; the node tests (tests/integration/test_agent_sandbox_driver.py) run the same
path against a real API server and kubelet.

What a real one does and a test needs on demand: close an idle exec (``drop``: a close frame, as the
kubelet's idle timeout or a pod deleted; ``cut``: the connection ends without one), never answer an
upgrade (``hang``: an API server waiting on a kubelet that does not answer), and hold its answer to a
client's close (``hold_close``). Everything a test waits on is a fact recorded here, waited for with
a deadline (``wait_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
PATH = "/api/v1/namespaces/{namespace}/pods/{pod}/exec"


@dataclass
class Exec:
    """One exec connection, as the server saw it."""

    pod: str
    command: list[str]
    upgraded: bool = False  # its process started and the 101 on its way: the client's open can return
    client_closed: bool = False  # the client's close frame arrived
    close_answered: bool = False  # the server answered it
    exit_code: int | None = None  # the process ended with this
    ended: bool = False  # the connection is over, on the server's side
    stdin: bytes = b""
    ws: Any = field(default=None, repr=False)
    transport: Any = field(default=None, repr=False)


class ExecServer:
    def __init__(self, rewrite: Callable[[str, list[str]], list[str]]) -> None:
        """``rewrite(pod, command)``: what runs for an exec of ``command`` in ``pod`` (a test moves the
        pod's paths under its tmp dir, and never lets a command signal this machine's PID 1)."""
        self._rewrite = rewrite
        self.execs: dict[str, list[Exec]] = {}
        #: Pods whose upgrade is never answered (until the client gives up).
        self.hang: set[str] = set()
        #: Pods whose client's close frame is answered only once released (``release_close``).
        self.hold_close: set[str] = set()
        self._released: dict[str, asyncio.Event] = {}
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="exec-server", daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- from the test's threads -----------------------------------------------------------------

    def start(self) -> ExecServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self) -> Any:
        """A kubernetes client Configuration aimed at this server (no TLS, no credentials)."""
        from kubernetes import client as k8s

        configuration = k8s.Configuration()
        configuration.host = self.host
        return configuration

    def of(self, pod: str) -> list[Exec]:
        with self._changed:
            return list(self.execs.get(pod, []))

    def wait_for(self, what: str, fact: Callable[[], bool], timeout_s: float = 20.0) -> None:
        """Until ``fact()`` holds (checked at each change the server records), or AssertionError."""
        with self._changed:
            if not self._changed.wait_for(fact, timeout_s):
                raise AssertionError(f"not within {timeout_s:.0f} s: {what}")

    def drop(self, pod: str, close_frame: bool = True) -> None:
        """End ``pod``'s latest open exec from the server's side: a close frame then the connection's
        end (``close_frame=False``: the connection ends without one). Returns once the connection is
        closed on the server's side (what was sent is then in the client's socket: loopback)."""
        asyncio.run_coroutine_threadsafe(self._drop(pod, close_frame), self._loop).result(10)

    def release_close(self, pod: str) -> None:
        self._loop.call_soon_threadsafe(self._release(pod).set)

    # -- on the server's loop ----------------------------------------------------------------------

    def _note(self, change: Callable[[], None]) -> None:
        with self._changed:
            change()
            self._changed.notify_all()

    def _release(self, pod: str) -> asyncio.Event:
        return self._released.setdefault(pod, asyncio.Event())

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        app.router.add_post(PATH, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.port = int(server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        for execs in list(self.execs.values()):
            for ex in execs:
                if ex.transport is not None and not ex.ended:
                    ex.transport.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _drop(self, pod: str, close_frame: bool) -> None:
        ex = next(e for e in reversed(self.execs.get(pod, [])) if e.upgraded and not e.ended)
        if close_frame:
            ex.transport.write(b"\x88\x02\x03\xe8")  # an unmasked close frame, status 1000
        ex.transport.close()
        while not ex.transport.is_closing():
            await asyncio.sleep(0)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        pod = request.match_info["pod"]
        ex = Exec(pod, list(request.query.getall("command", [])), transport=request.transport)
        self._note(lambda: self.execs.setdefault(pod, []).append(ex))
        try:
            if pod in self.hang:
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.02)  # (the server waiting on a kubelet; until the client leaves)
                return web.Response(status=504)
            return await self._serve(request, ex)
        finally:
            self._note(lambda: setattr(ex, "ended", True))

    async def _serve(self, request: web.Request, ex: Exec) -> web.StreamResponse:
        # The process first, then the answer: once the client's open returns, its process is running.
        process = await asyncio.create_subprocess_exec(
            *self._rewrite(ex.pod, ex.command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        ws = web.WebSocketResponse(protocols=PROTOCOLS, autoclose=False, timeout=2.0, compress=False)
        ex.ws = ws
        self._note(lambda: setattr(ex, "upgraded", True))
        try:
            await ws.prepare(request)
        except BaseException:
            process.kill()
            await process.wait()
            raise
        pumps = [
            asyncio.create_task(self._pump(process.stdout, ws, 1)),
            asyncio.create_task(self._pump(process.stderr, ws, 2)),
        ]
        reader = asyncio.create_task(self._read(ws, process, ex))
        exited = asyncio.create_task(process.wait())
        await asyncio.wait({reader, exited}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done() and not ex.client_closed:
            code = exited.result()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._note(lambda: setattr(ex, "exit_code", code))
            with contextlib.suppress(Exception):
                await ws.send_bytes(b"\x03" + json.dumps(_status(code)).encode())
            with contextlib.suppress(Exception):
                await ws.close()  # a close frame; the client's answer waited for up to 2 s
        else:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        for task in (*pumps, reader):
            task.cancel()
        await asyncio.gather(*pumps, reader, return_exceptions=True)
        return ws

    async def _pump(self, stream: Any, ws: web.WebSocketResponse, channel: int) -> None:
        """A process's output, as frames on ``channel``."""
        while chunk := await stream.read(4096):
            with contextlib.suppress(Exception):
                await ws.send_bytes(bytes([channel]) + chunk)

    async def _read(self, ws: web.WebSocketResponse, process: Any, ex: Exec) -> None:
        while True:
            msg = await ws.receive()
            if msg.type == WSMsgType.BINARY and msg.data:
                channel, data = msg.data[0], msg.data[1:]
                if channel == 0 and process.stdin is not None:
                    ex.stdin += data
                    process.stdin.write(data)
                    with contextlib.suppress(ConnectionError):
                        await process.stdin.drain()
                elif channel == 255 and data[:1] == b"\x00" and process.stdin is not None:
                    process.stdin.close()
                continue
            if msg.type == WSMsgType.CLOSE:
                self._note(lambda: setattr(ex, "client_closed", True))
                if ex.pod in self.hold_close:
                    await self._release(ex.pod).wait()
                await ws.close()
                self._note(lambda: setattr(ex, "close_answered", True))
            return  # closed, closing, or an error: the connection is over


def _status(code: int) -> dict[str, Any]:
    """The exec's end as the kubelet reports it on channel 3."""
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: exit status {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }
