"""One watch on this installation's SandboxClaims, shared by every warm delivery of the driver.

A delivery waits for its claim to name a Sandbox (the controller's adoption). Polling that costs a
GET per delivery every poll interval (a burst of 20 claims polled every 20 ms is 1,000 GETs a
second on the API server, which is what adopts them) and finds a change half an interval late on
average. The watch gets each change as the API server sends it, in one long request: a delivery
reads its claim from the watch's copy and sleeps until that copy changes.

The copy can lag the API server: a claim just created may not be in it yet, so an absent claim
means "not seen yet", never "gone", and every wait ends after ``fallback_s`` at most, when the
delivery reads the claim from the API server itself (as it did before the watch; also what it does
while the watch is down). A watch that fails is listed and watched again after a pause (the one
bounded backoff, :class:`resilience.episode.Episode`: logged once per outage, with its end, however
long it lasts); it is never a reason for a delivery to fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

from drivers.agent_sandbox.warm import CLAIMS, EXT_GROUP, EXT_VERSION
from resilience.episode import Episode

#: A watch request's server-side timeout (it is then opened again from the last version seen).
WATCH_TIMEOUT_S: Final = 60
#: Pause after a failed list or watch before the next try, doubled per failure in a row up to the most.
RETRY_S: Final = 1.0
RETRY_MAX_S: Final = 30.0
#: A watch request that ends sooner than this having brought nothing counts as a failure (a server
#: that closes every watch at once would otherwise be asked again and again without a pause).
MIN_WATCH_S: Final = 1.0


class Change:
    """One waiter's flag: the claim it listens to has changed since it was last cleared."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout_s: float) -> bool:
        """True once the claim changed, False after ``timeout_s`` without a change."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class ClaimWatch:
    """The claims of one installation in one namespace, as the watch last saw them."""

    def __init__(
        self,
        make_custom_api: Callable[[], Any],
        namespace: str,
        selector: str,
        logger: logging.Logger,
        *,
        pause: Callable[[float], object] | None = None,
    ) -> None:
        """``pause(seconds)`` waits before the next try after a failure (default: until ``stop``, at most
        that long; a test passes its own to run a long outage at once)."""
        self._make_custom_api = make_custom_api
        self._namespace = namespace
        self._selector = selector
        self._logger = logger
        self._claims: dict[str, dict[str, Any]] = {}
        self._synced = False  # a list has filled the copy since the last failure
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: Any = None
        self._pause = pause if pause is not None else self._stop.wait
        #: Failures in a row and the pause before the next try; logs the outage once, and its end.
        self.retry = Episode(
            "agent-sandbox claim watch (deliveries read their claims meanwhile)",
            logger,
            first_delay_s=RETRY_S,
            max_delay_s=RETRY_MAX_S,
        )

    def start(self) -> None:
        """Start watching (once; from the event loop the deliveries run on)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="agent-sandbox-claim-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching: the thread ends at the next event or its request's timeout (a daemon)."""
        self._stop.set()
        self._synced = False
        if self._watch is not None:
            self._watch.stop()

    def claim(self, name: str) -> dict[str, Any] | None:
        """The claim ``name`` as the watch saw it last, or None (not seen, gone, or no copy now)."""
        return self._claims.get(name) if self._synced else None

    @property
    def synced(self) -> bool:
        return self._synced

    @contextlib.contextmanager
    def listening(self, name: str) -> Iterator[Change]:
        """A :class:`Change` of the claim ``name`` for the ``with``: set by every change the watch
        sees from the moment it is made (clear it before each read, then wait on it)."""
        change = Change()
        self._waiters.setdefault(name, set()).add(change.event)
        try:
            yield change
        finally:
            waiting = self._waiters.get(name)
            if waiting is not None:
                waiting.discard(change.event)
                if not waiting:
                    del self._waiters[name]

    # -- the watch's thread -------------------------------------------------------------------------

    def _wake(self, names: list[str] | None) -> None:
        """On the event loop: wake the waiters of ``names`` (None: all of them)."""
        for name in list(self._waiters) if names is None else names:
            for event in self._waiters.get(name, ()):
                event.set()

    def _notify(self, names: list[str] | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake, names)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        custom = self._make_custom_api()
        new_watch: Any = watch.Watch  # untyped in the client
        version = ""
        while not self._stop.is_set():
            seen = 0  # the events this watch request brought
            try:
                if not version:
                    listed = custom.list_namespaced_custom_object(
                        EXT_GROUP, EXT_VERSION, self._namespace, CLAIMS, label_selector=self._selector
                    )
                    self._claims = {str(item["metadata"]["name"]): item for item in listed.get("items") or []}
                    version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                    self._synced = True
                    self._notify(None)
                began = time.monotonic()
                self._watch = stream = new_watch()
                for event in stream.stream(
                    custom.list_namespaced_custom_object,
                    EXT_GROUP,
                    EXT_VERSION,
                    self._namespace,
                    CLAIMS,
                    label_selector=self._selector,
                    resource_version=version,
                    timeout_seconds=WATCH_TIMEOUT_S,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        break
                    obj = event.get("object") or {}
                    kind = event.get("type")
                    if kind == "ERROR":  # 410 Gone and the like: list again
                        version = ""
                        break
                    seen += 1
                    if seen == 1:
                        self.retry.recovered()  # listed and watching: the backoff starts over
                    meta = obj.get("metadata") or {}
                    version = str(meta.get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    name = str(meta.get("name", ""))
                    if kind == "DELETED":
                        self._claims.pop(name, None)
                    else:
                        self._claims[name] = obj
                    self._notify([name])
                if self._stop.is_set():
                    break
                if not seen and time.monotonic() - began < MIN_WATCH_S:
                    self._failed(ConnectionError("the watch ended at once, having brought nothing"))
                else:
                    self.retry.recovered()  # a watch that ran its course: an outage's end is logged
            except ApiException as exc:
                if exc.status == 410 and seen and not self._stop.is_set():  # too old: list again
                    version = ""
                    continue
                self._failed(exc)
                version = ""
            except Exception as exc:
                self._failed(exc)
                version = ""
        self._synced = False

    def _failed(self, exc: Exception) -> None:
        """Count the failure (an outage is logged once), send the waiters to read their claims
        themselves, and pause before the next try (bounded, however many failures in a row)."""
        if self._stop.is_set():
            return
        was_synced, self._synced = self._synced, False
        delay = self.retry.failed(exc)
        if was_synced:
            self._notify(None)
        self._pause(delay)
