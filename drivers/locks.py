"""Per-sandbox locks that exist only while they are used.

A driver serializes its actions on one sandbox name (ensure, deprovision, the idle sweep's suspend)
with one :class:`asyncio.Lock` per name. A pod that runs for months sees millions of names, so a lock
must not outlive its use, and it must not be dropped while a task waits on it either: a second lock
made for the same name would let a third caller in beside the waiter. :class:`KeyedLocks` counts the
holder and the waiters of each name and forgets the lock when the last of them leaves, so the map
holds exactly the names in use (also for sandboxes that are never deprovisioned: a refused or failed
ensure leaves nothing behind).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class _Entry:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        #: The holder and the waiters.
        self.users = 0


class KeyedLocks:
    """One lock per key while somebody holds or waits on it; none otherwise."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0 and self._entries.get(key) is entry:
                del self._entries[key]

    def users(self, key: str) -> int:
        """The holder and waiters of ``key`` now (0: no lock is kept for it)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.users

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
