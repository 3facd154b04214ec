"""The thread a transactional producer's blocking librdkafka calls run in, answering on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class Worker:
    """One daemon thread running a producer's blocking calls in order, answering on the loop.

    A daemon thread, not an executor's: a call stuck inside librdkafka must not keep the
    interpreter from exiting (``ThreadPoolExecutor`` threads are joined at exit).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            try:
                result = call()
            except BaseException as exc:  # handed to the awaiting coroutine
                _answer(future, None, exc)
            else:
                _answer(future, result, None)
            del item, call, future  # no reference to the producer outlives the call

    def submit(self, call: Callable[[], _T]) -> asyncio.Future[_T]:
        future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._calls.put((call, future))
        return future

    def stop(self) -> None:
        self._calls.put(None)


def _answer(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            return  # the waiter gave up (deadline, cancellation) and cancelled it: dropped
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        future.get_loop().call_soon_threadsafe(settle)


__all__ = ["Worker"]
