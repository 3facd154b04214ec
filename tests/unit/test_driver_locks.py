"""The drivers' per-sandbox locks (``drivers.locks.KeyedLocks``): one lock per name while it is used.

The earlier per-driver ``_forget_lock`` deleted a lock that was not held while a task still waited on
it, so the next caller made a second lock for the same name and ran beside the waiter; and a name whose
sandbox was never deprovisioned (a refused or failed ensure) kept its lock for ever.
"""

from __future__ import annotations

import asyncio

from drivers.locks import KeyedLocks


async def test_a_lock_is_kept_while_a_waiter_is_queued_and_forgotten_when_the_last_leaves() -> None:
    locks = KeyedLocks()
    inside: list[str] = []
    first_in, first_may_leave = asyncio.Event(), asyncio.Event()

    async def holder(who: str, gate: asyncio.Event | None = None) -> None:
        async with locks.hold("sbx-wfx-1"):
            inside.append(f"{who} in")
            if gate is not None:
                first_in.set()
                await gate.wait()
            assert inside[-1] == f"{who} in", "two holders at once"
            inside.append(f"{who} out")

    first = asyncio.create_task(holder("first", first_may_leave))
    await first_in.wait()
    second = asyncio.create_task(holder("second"))
    while locks.users("sbx-wfx-1") < 2:  # the second is queued on the same lock
        await asyncio.sleep(0)
    third = asyncio.create_task(holder("third"))  # arrives while the second still waits
    while locks.users("sbx-wfx-1") < 3:
        await asyncio.sleep(0)
    first_may_leave.set()
    await asyncio.gather(first, second, third)
    assert inside == ["first in", "first out", "second in", "second out", "third in", "third out"]
    assert "sbx-wfx-1" not in locks and len(locks) == 0


async def test_a_failed_or_cancelled_action_leaves_no_lock_behind() -> None:
    locks = KeyedLocks()
    try:
        async with locks.hold("sbx-wfx-refused"):
            raise RuntimeError("the ensure was refused")
    except RuntimeError:
        pass
    assert len(locks) == 0
    held = asyncio.Event()

    async def hold_for_ever() -> None:
        async with locks.hold("sbx-wfx-2"):
            held.set()
            await asyncio.Event().wait()

    holder = asyncio.create_task(hold_for_ever())
    await held.wait()
    waiter = asyncio.create_task(locks.hold("sbx-wfx-2").__aenter__())
    while locks.users("sbx-wfx-2") < 2:
        await asyncio.sleep(0)
    waiter.cancel()  # a waiter given up (its caller stopped)
    holder.cancel()
    await asyncio.gather(holder, waiter, return_exceptions=True)
    assert len(locks) == 0
