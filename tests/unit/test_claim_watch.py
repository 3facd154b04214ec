"""The claim watch's retry loop (``drivers.agent_sandbox.claim_watch``) through a long outage, broker-
and cluster-free: the API it is given fails a million times in a row, then answers. The watch on a
real API server (its list, its events, a delivery woken by them) is
tests/integration/test_agent_sandbox_driver.py's warm tests on the node."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from drivers.agent_sandbox.claim_watch import RETRY_MAX_S, RETRY_S, ClaimWatch

OUTAGE = 1_000_000


class _Events:
    """A watch request's response: the lines it is given, until it is closed."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.more = threading.Condition()
        self.closed = False

    def send(self, event: dict[str, Any]) -> None:
        with self.more:
            self.lines.append(json.dumps(event).encode() + b"\n")
            self.more.notify_all()

    def end(self) -> None:
        with self.more:
            self.closed = True
            self.more.notify_all()

    def stream(self, amt: Any = None, decode_content: Any = None) -> Iterator[bytes]:
        while True:
            with self.more:
                self.more.wait_for(lambda: self.lines or self.closed, timeout=30)
                if self.lines:
                    yield self.lines.pop(0)
                    continue
                return

    def close(self) -> None:
        self.end()

    def release_conn(self) -> None:
        pass


class _Api:
    """A CustomObjectsApi that is down for ``failures`` calls, then lists one claim and watches."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.events = _Events()

    def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionResetError("the API server is away")
        if kwargs.get("watch"):
            return self.events
        claim = {"metadata": {"name": "c1", "resourceVersion": "7"}, "status": {}}
        return {"items": [claim], "metadata": {"resourceVersion": "7"}}


def test_a_million_failures_in_a_row_keep_the_claim_watch_alive_with_bounded_pauses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = _Api(OUTAGE)
    pauses = {"count": 0, "max": 0.0, "min": float("inf"), "at_cap": 0}

    def pause(seconds: float) -> None:  # the outage run at once: the pause asked for, not waited
        pauses["count"] += 1
        pauses["max"] = max(pauses["max"], seconds)
        pauses["min"] = min(pauses["min"], seconds)
        pauses["at_cap"] += seconds >= RETRY_MAX_S * 0.5  # jitter takes at most a fraction off

    logger = logging.getLogger("test.claim_watch.outage")

    async def run() -> None:
        watch = ClaimWatch(lambda: api, "ns", "sel", logger, pause=pause)
        with caplog.at_level(logging.INFO, logger=logger.name), watch.listening("c1") as change:
            watch.start()
            # The fact: after the outage the watch has listed the claim (its thread alive throughout).
            assert await change.wait(120), "the claim watch never came back after the outage"
            assert watch.synced and watch.claim("c1") is not None
            thread = watch._thread
            assert thread is not None and thread.is_alive()
            change.clear()
            api.events.send(
                {"type": "MODIFIED", "object": {"metadata": {"name": "c1", "resourceVersion": "8"}}}
            )
            assert await change.wait(30), "a change after the outage did not reach its waiter"
            assert (watch.claim("c1") or {})["metadata"]["resourceVersion"] == "8"
            watch.stop()
            api.events.end()
            await asyncio.to_thread(thread.join, 30)
            assert not thread.is_alive()

    asyncio.run(run())
    assert api.calls >= OUTAGE + 2  # every failure tried again, then the list and the watch
    assert pauses["count"] == OUTAGE
    assert pauses["max"] <= RETRY_MAX_S  # bounded: no OverflowError, no inf, never past the cap
    assert pauses["min"] > 0 and pauses["min"] <= RETRY_S
    assert pauses["at_cap"] >= OUTAGE - 10  # the pause stopped growing at the cap within a few tries
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger.name]
    errors = [m for level, m in records if level >= logging.ERROR]
    assert len(errors) == 1 and "claim watch" in errors[0], records  # one line for the whole outage
    print(
        f"\n{OUTAGE:,} failures in a row: pauses {pauses['min']:.2f}-{pauses['max']:.2f} s, "
        f"{pauses['at_cap']:,} at the cap; log lines {len(records)}"
    )


class _ClosesAtOnce(_Api):
    """An API server that lists fine but ends every watch at once, bringing nothing."""

    def __init__(self) -> None:
        super().__init__(0)

    def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            self.calls += 1
            ended = _Events()
            ended.end()
            return ended
        return {"items": [], "metadata": {"resourceVersion": "7"}}


def test_a_watch_that_ends_at_once_every_time_is_asked_again_on_the_backoff_not_at_once() -> None:
    api = _ClosesAtOnce()
    pauses: list[float] = []
    done = threading.Event()

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 8:
            done.set()

    async def run() -> None:
        watch = ClaimWatch(
            lambda: api, "ns", "sel", logging.getLogger("test.claim_watch.closes"), pause=pause
        )
        watch.start()
        assert await asyncio.to_thread(done.wait, 30), "the watch never paused"
        watch.stop()
        assert watch._thread is not None
        await asyncio.to_thread(watch._thread.join, 30)

    asyncio.run(run())
    assert len(pauses) >= 8 and abs(api.calls - len(pauses)) <= 1  # a pause after every watch request
    unjittered = [RETRY_S * 2**n for n in range(8)]
    for asked, full in zip(pauses, unjittered, strict=False):
        assert min(full, RETRY_MAX_S) * 0.75 <= asked <= min(full, RETRY_MAX_S)  # doubling to the cap
