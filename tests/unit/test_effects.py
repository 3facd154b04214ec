"""The effect runner on its own: concurrency across sandboxes, order within one, ownership.

No sleep decides a verdict here: a test waits for the state it needs (a call inside the driver,
calls held at the gate, the runner idle) with a deadline, and the driver stand-in holds a call
until the test releases it, so "still running" is a fact, not a guess about timing.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from consumers.lanes.commands import Command, CommandResult, Deprovision, Ensure
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.runtime.effects import EffectRunner
from consumers.runtime.stall_guard import StallGuard

MINT = SandboxCredentialRequest("workflow", "", "wfx", "org", "usr")


def ensure(sandbox_id: str) -> Ensure:
    return Ensure("workflow", sandbox_id, f"wfexec:{sandbox_id}", "", MINT, True)


def teardown(sandbox_id: str) -> Deprovision:
    return Deprovision("workflow", sandbox_id, 5)


class Recorder:
    """A driver stand-in that takes ``delay_s`` per call and records start/end order."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.events: list[tuple[str, str, str]] = []
        self.running = 0
        self.peak = 0

    async def __call__(self, command: Command) -> CommandResult:
        op = type(command).__name__
        self.events.append(("start", op, command.sandbox_id))
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        self.events.append(("end", op, command.sandbox_id))
        return CommandResult(ok=True)


class Held(Recorder):
    """A driver stand-in whose calls stay inside the driver until the test releases them
    (per sandbox, or all at once), so a test knows which calls are running."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.release_all = asyncio.Event()
        self.released: dict[str, asyncio.Event] = {}

    def release(self, sandbox_id: str) -> None:
        self.released.setdefault(sandbox_id, asyncio.Event()).set()

    def started(self, op: str, sandbox_id: str) -> int:
        return self.events.count(("start", op, sandbox_id))

    async def __call__(self, command: Command) -> CommandResult:
        op = type(command).__name__
        self.events.append(("start", op, command.sandbox_id))
        self.running += 1
        self.peak = max(self.peak, self.running)
        mine = self.released.setdefault(command.sandbox_id, asyncio.Event())
        waits = {asyncio.ensure_future(mine.wait()), asyncio.ensure_future(self.release_all.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.running -= 1
        self.events.append(("end", op, command.sandbox_id))
        return CommandResult(ok=True)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (polled on the loop) with a deadline; a timeout fails the test."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"not reached in {timeout_s}s: {what}") from None


async def until_done(runner: EffectRunner, n: int, timeout_s: float = 10.0) -> list[str]:
    taken: list[str] = []
    async with asyncio.timeout(timeout_s):
        while len(taken) < n:
            await runner.ready.wait()
            taken += [c.effect_id for c in runner.take()]
    return taken


async def test_calls_for_different_sandboxes_run_concurrently_up_to_the_bound() -> None:
    recorder = Held()
    runner = EffectRunner(recorder, concurrency=8)
    for i in range(16):
        assert runner.submit(0, f"wfx_{i}", f"e{i}", ensure(f"wfx_{i}"))
    # Nothing returns until eight are inside the driver at once: concurrent, not one by one.
    await until(lambda: recorder.running >= 8, "eight calls inside the driver at once")
    recorder.release_all.set()
    await until_done(runner, 16)
    assert recorder.peak == 8  # eight at once, never more (all sixteen were submitted together)
    assert runner.outstanding == 0


async def test_calls_for_one_sandbox_run_in_submission_order_never_overlapping() -> None:
    recorder = Recorder(0.05)
    runner = EffectRunner(recorder, concurrency=8)
    runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "teardown", teardown("wfx_a"))
    runner.submit(1, "wfx_b", "other", ensure("wfx_b"))
    done = await until_done(runner, 3)
    mine = [e for e in recorder.events if e[2] == "wfx_a"]
    assert mine == [
        ("start", "Ensure", "wfx_a"),
        ("end", "Ensure", "wfx_a"),
        ("start", "Deprovision", "wfx_a"),
        ("end", "Deprovision", "wfx_a"),
    ]
    assert done.index("ensure") < done.index("teardown")


async def test_a_resubmitted_effect_id_runs_once() -> None:
    recorder = Recorder(0.05)
    runner = EffectRunner(recorder, concurrency=4)
    assert runner.submit(0, "wfx_a", "e1", ensure("wfx_a"))
    assert not runner.submit(0, "wfx_a", "e1", ensure("wfx_a"))
    await until_done(runner, 1)
    assert [e for e in recorder.events if e[0] == "start"] == [("start", "Ensure", "wfx_a")]


async def test_a_disowned_partition_drops_queued_calls_and_voids_running_results() -> None:
    recorder = Held()
    runner = EffectRunner(recorder, concurrency=4)
    runner.own([0, 1])
    runner.submit(0, "wfx_a", "running", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "queued", teardown("wfx_a"))
    runner.submit(1, "wfx_b", "kept", ensure("wfx_b"))
    # The two ensures are inside the driver; the teardown waits behind wfx_a's.
    await until(
        lambda: recorder.started("Ensure", "wfx_a") == 1 and recorder.started("Ensure", "wfx_b") == 1,
        "both ensures running",
    )
    runner.disown([0])
    recorder.release_all.set()
    done = await until_done(runner, 1)
    assert done == ["kept"]
    assert await runner.wait_idle(2.0)  # every chain ended: wfx_a's ensure returned, its queue is empty
    assert ("end", "Ensure", "wfx_a") in recorder.events
    assert runner.take() == []  # the running call finished; its result is void
    assert ("start", "Deprovision", "wfx_a") not in recorder.events  # the queued one never ran
    assert runner.outstanding == 0
    # Owned again (the partition came back): the same effect ids may run again.
    runner.own([0])
    assert runner.submit(0, "wfx_a", "queued", teardown("wfx_a"))
    assert await until_done(runner, 1) == ["queued"]


async def test_taken_back_while_its_ensure_still_runs_the_outbox_order_holds() -> None:
    """Disowned and owned again while the ensure still runs (a rejoin after a failed commit):
    the outbox hands the same ensure and its teardown back. The ensure must run again (its old
    result is void) and the teardown must wait for it; a teardown that overtook the ensure
    would leave a terminal execution recording a live sandbox."""
    recorder = Held()
    runner = EffectRunner(recorder, concurrency=4)
    runner.own([0])
    runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "teardown", teardown("wfx_a"))
    await until(lambda: recorder.started("Ensure", "wfx_a") == 1, "the ensure inside the driver")
    runner.disown([0])
    runner.own([0])
    assert runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))
    assert runner.submit(0, "wfx_a", "teardown", teardown("wfx_a"))
    assert not runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))  # now it is current again
    assert recorder.running == 1  # the old ensure is still inside the driver
    recorder.release_all.set()
    assert await until_done(runner, 2) == ["ensure", "teardown"]
    assert [e[1] for e in recorder.events if e[0] == "start"] == ["Ensure", "Ensure", "Deprovision"]
    assert await runner.wait_idle(2.0)
    assert runner.outstanding == 0


async def test_results_not_yet_taken_when_disowned_leave_nothing_outstanding() -> None:
    recorder = Recorder(0.01)
    runner = EffectRunner(recorder, concurrency=4)
    runner.own([0])
    runner.submit(0, "wfx_a", "e1", ensure("wfx_a"))
    await runner.ready.wait()
    runner.disown([0])
    assert runner.take() == []
    assert runner.outstanding == 0


async def test_a_call_whose_partition_moved_while_it_waited_at_the_gate_never_reaches_the_driver() -> None:
    """The epoch is judged when the call is about to run: a revocation during the stall guard's
    hold (or while the call waited for a slot) drops it before the driver is called."""
    recorder = Recorder(0.01)
    opened = asyncio.Event()
    at_gate = 0

    async def gate() -> None:
        nonlocal at_gate
        at_gate += 1
        await opened.wait()

    runner = EffectRunner(recorder, concurrency=2, gate=gate)
    runner.submit(0, "wfx_moved", "moved", ensure("wfx_moved"))
    runner.submit(1, "wfx_kept", "kept", ensure("wfx_kept"))
    await until(lambda: at_gate == 2, "both calls held at the gate")
    runner.disown([0])  # the group took partition 0 away while the calls were held
    opened.set()
    done = await until_done(runner, 1)
    # Both chains have ended (the moved call's included): had it reached the driver, it would show.
    assert await runner.wait_idle(2.0)
    assert done == ["kept"]
    assert [e for e in recorder.events if e[0] == "start"] == [("start", "Ensure", "wfx_kept")]
    assert runner.outstanding == 0


async def test_the_stall_guard_holds_calls_after_a_stall_that_may_have_cost_the_membership() -> None:
    now = [100.0]
    #: Clock reads per task: how a test knows the watch and a waiting clear() looked again.
    reads: Counter[object] = Counter()

    def clock() -> float:
        reads[asyncio.current_task()] += 1
        return now[0]

    guard = StallGuard(session_timeout_s=10.0, heartbeat_interval_s=3.0, clock=clock)
    assert (guard.stall_s, guard.hold_s) == (4.0, 6.0)
    stop = asyncio.Event()
    watch = asyncio.create_task(guard.watch(stop))
    # The watch has looked twice: it is past its first look and watching.
    await until(lambda: reads[watch] >= 2, "the watch running")
    now[0] += 3.9  # shorter than session - 2 heartbeats: the membership cannot be lost
    await asyncio.wait_for(guard.clear(), 1)
    assert guard.stalls == 0 and not guard.holding
    now[0] += 4.0  # the process stood still (SIGSTOP): the next call, whoever looks first, holds
    cleared = asyncio.create_task(guard.clear())
    await until(lambda: guard.stalls == 1, "the stall seen")
    # clear() looked at the clock again after the stall and is still waiting (not returned).
    looked = reads[cleared]
    await until(lambda: reads[cleared] >= looked + 2, "clear() looking again")
    assert guard.stalls == 1 and guard.holding and not cleared.done()
    now[0] += 3.0
    looked = reads[cleared]
    await until(lambda: reads[cleared] >= looked + 2, "clear() looking again")
    assert not cleared.done()  # 3 s of the 6 s hold: still held
    now[0] += 3.0  # two heartbeat intervals after the stall
    await asyncio.wait_for(cleared, 1)
    assert guard.stalls == 1
    assert not guard.holding
    stop.set()
    await watch
    # An unwatched loop (no pod running the watch) never holds: its gaps are idleness.
    idle = StallGuard(10.0, 3.0, clock=lambda: now[0])
    now[0] += 60
    await asyncio.wait_for(idle.clear(), 1)
    assert idle.stalls == 0


async def test_an_exclusive_turn_runs_after_the_sandboxs_queued_calls_and_before_later_ones() -> None:
    """The reaper's removal takes the sandbox's turn: it waits for the ensure running and the one
    queued, a teardown submitted while it runs waits for it, another sandbox is not held up, a
    disown does not drop it, and its result (or exception) is its caller's."""
    driver = Held()
    runner = EffectRunner(driver, concurrency=4)
    runner.own([0])
    runner.submit(0, "wfx_a", "e1", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "e2", ensure("wfx_a"))
    await until(lambda: driver.started("Ensure", "wfx_a") == 1, "the first ensure runs")
    order: list[str] = []
    turn_held = asyncio.Event()

    async def work() -> str:
        order.append("turn start")
        await turn_held.wait()
        order.append("turn end")
        return "kept"

    turn = asyncio.create_task(runner.exclusive("workflow", "wfx_a", work))
    runner.disown([7])  # another partition's revocation: the turn belongs to none, it stays
    runner.submit(0, "wfx_b", "e3", ensure("wfx_b"))
    await until(lambda: driver.started("Ensure", "wfx_b") == 1, "another sandbox runs meanwhile")
    assert order == [] and not turn.done()
    driver.release("wfx_a")
    await until(lambda: order == ["turn start"], "the turn starts after both ensures")
    assert driver.started("Ensure", "wfx_a") == 2
    runner.submit(0, "wfx_a", "e4", teardown("wfx_a"))
    chain = runner._chains[("workflow", "wfx_a")]
    assert [type(entry).__name__ for entry in chain] == ["_Turn", "_Call"]  # queued behind the turn
    assert driver.started("Deprovision", "wfx_a") == 0
    turn_held.set()
    assert await asyncio.wait_for(turn, 10) == "kept"
    await until(lambda: driver.started("Deprovision", "wfx_a") == 1, "the teardown follows the turn")
    assert order == ["turn start", "turn end"]
    driver.release("wfx_b")

    async def fails() -> str:
        raise RuntimeError("the driver refused")

    try:
        await asyncio.wait_for(runner.exclusive("workflow", "wfx_c", fails), 10)
    except RuntimeError as exc:
        assert str(exc) == "the driver refused"
    else:
        raise AssertionError("the turn's exception is its caller's")
    assert runner.outstanding == 4  # turns are not effects: nothing to fold back
    await until_done(runner, 4)
