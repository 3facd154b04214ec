"""The effect runner on its own: concurrency across sandboxes, order within one, ownership."""

from __future__ import annotations

import asyncio

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


async def until_done(runner: EffectRunner, n: int, timeout_s: float = 10.0) -> list[str]:
    taken: list[str] = []
    async with asyncio.timeout(timeout_s):
        while len(taken) < n:
            await runner.ready.wait()
            taken += [c.effect_id for c in runner.take()]
    return taken


async def test_calls_for_different_sandboxes_run_concurrently_up_to_the_bound() -> None:
    recorder = Recorder(0.2)
    runner = EffectRunner(recorder, concurrency=8)
    for i in range(16):
        assert runner.submit(0, f"wfx_{i}", f"e{i}", ensure(f"wfx_{i}"))
    await until_done(runner, 16)
    assert recorder.peak == 8  # eight at once, never more
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
    recorder = Recorder(0.2)
    runner = EffectRunner(recorder, concurrency=4)
    runner.own([0, 1])
    runner.submit(0, "wfx_a", "running", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "queued", teardown("wfx_a"))
    runner.submit(1, "wfx_b", "kept", ensure("wfx_b"))
    await asyncio.sleep(0.05)  # the two ensures are running, the teardown waits behind wfx_a's
    runner.disown([0])
    done = await until_done(runner, 1)
    assert done == ["kept"]
    assert await runner.wait_idle(2.0)
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
    recorder = Recorder(0.2)
    runner = EffectRunner(recorder, concurrency=4)
    runner.own([0])
    runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))
    runner.submit(0, "wfx_a", "teardown", teardown("wfx_a"))
    await asyncio.sleep(0.05)
    runner.disown([0])
    runner.own([0])
    assert runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))
    assert runner.submit(0, "wfx_a", "teardown", teardown("wfx_a"))
    assert not runner.submit(0, "wfx_a", "ensure", ensure("wfx_a"))  # now it is current again
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

    async def gate() -> None:
        await opened.wait()

    runner = EffectRunner(recorder, concurrency=2, gate=gate)
    runner.submit(0, "wfx_moved", "moved", ensure("wfx_moved"))
    runner.submit(1, "wfx_kept", "kept", ensure("wfx_kept"))
    await asyncio.sleep(0.05)
    runner.disown([0])  # the group took partition 0 away while the calls were held
    opened.set()
    done = await until_done(runner, 1)
    await asyncio.sleep(0.05)
    assert done == ["kept"]
    assert [e for e in recorder.events if e[0] == "start"] == [("start", "Ensure", "wfx_kept")]
    assert runner.outstanding == 0


async def test_the_stall_guard_holds_calls_after_a_stall_that_may_have_cost_the_membership() -> None:
    now = [100.0]
    guard = StallGuard(session_timeout_s=10.0, heartbeat_interval_s=3.0, clock=lambda: now[0])
    assert (guard.stall_s, guard.hold_s) == (4.0, 6.0)
    stop = asyncio.Event()
    watch = asyncio.create_task(guard.watch(stop))
    await asyncio.sleep(0)
    now[0] += 3.9  # shorter than session - 2 heartbeats: the membership cannot be lost
    await asyncio.wait_for(guard.clear(), 1)
    assert guard.stalls == 0 and not guard.holding
    now[0] += 4.0  # the process stood still (SIGSTOP): the next call, whoever looks first, holds
    cleared = asyncio.create_task(guard.clear())
    await asyncio.sleep(0.25)
    assert guard.stalls == 1 and guard.holding and not cleared.done()
    now[0] += 3.0
    await asyncio.sleep(0.25)
    assert not cleared.done()
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
