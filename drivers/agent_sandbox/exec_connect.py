"""An exec into a pod whose every blocking step has a deadline.

The kubernetes client's ``stream()`` opens an exec's websocket with no timeout at all: its
``create_websocket`` builds a ``websocket.WebSocket`` and connects it without one, so the socket
blocks for ever on a peer that accepts the TCP connection and never answers the upgrade (an API
server overloaded, or waiting on a kubelet that does not answer). A thread that runs such an open
never comes back, and the driver's threads are few. Nothing in the client passes a timeout through
(``_request_timeout`` bounds only a preloaded call's reading), so the one place to give the connect
its deadline is the ``WebSocket`` the client makes: :func:`open_exec` has it made, on its own thread
only, with ``timeout`` set, which websocket-client applies to the TCP connect, the TLS handshake,
the upgrade, and every later send and receive on that socket (a write into a stalled stream and a
close included). Everything else (URL, headers, TLS options, proxy, the channel protocol) is the
client's own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes.stream import stream, ws_client
from websocket import WebSocket

#: The longest one blocking step of an exec's websocket may take: the connect (TCP, TLS, the upgrade,
#: which the API server answers once its stream to the kubelet is up), then each send and receive.
CONNECT_TIMEOUT_S: Final = 10.0

_deadline = threading.local()  # the socket timeout of the exec this thread is opening, if any


class _DeadlineWebSocket(WebSocket):
    """The client's ``WebSocket``, given the opening thread's deadline (none: as the client made it)."""

    def connect(self, url: str, **options: Any) -> None:
        timeout = getattr(_deadline, "timeout_s", None)
        if timeout is not None and options.get("timeout") is None:
            options["timeout"] = timeout
        super().connect(url, **options)  # type: ignore[no-untyped-call]


def _install() -> None:
    """Have the client make :class:`_DeadlineWebSocket` s (it behaves as before on any other thread)."""
    client_module: Any = ws_client  # (its names are untyped)
    if client_module.WebSocket is not _DeadlineWebSocket:
        client_module.WebSocket = _DeadlineWebSocket


def open_exec(
    configuration: Any,
    pod: str,
    namespace: str,
    container: str,
    command: list[str],
    *,
    timeout_s: float = CONNECT_TIMEOUT_S,
) -> tuple[Any, Any]:
    """(Blocking, at most about ``timeout_s`` per step) an exec in ``pod`` with stdin, stdout and stderr:
    ``(its ApiClient, its WSClient)``. The ApiClient is its own: ``stream()`` swaps the client's request
    method for the call's duration, so an exec on a shared client would send concurrent REST calls over
    websockets. The caller closes both (:func:`close_exec`)."""
    _install()
    api_client: Any = k8s.ApiClient(configuration)
    _deadline.timeout_s = timeout_s
    try:
        resp: Any = stream(
            k8s.CoreV1Api(api_client).connect_get_namespaced_pod_exec,
            pod,
            namespace,
            container=container,
            command=command,
            stdin=True,
            stdout=True,
            stderr=True,
            tty=False,
            _preload_content=False,
        )
    except BaseException:
        api_client.close()
        raise
    finally:
        _deadline.timeout_s = None
    return api_client, resp


def close_exec(api_client: Any, resp: Any, timeout_s: float) -> None:
    """(Blocking, at most about ``timeout_s``) close an exec's websocket (waiting that long for the
    server's answer to the close) and its ApiClient; errors are the stream's end anyway."""
    with contextlib.suppress(Exception):  # a stream already gone
        resp.close(timeout=timeout_s)
    with contextlib.suppress(Exception):
        api_client.close()
