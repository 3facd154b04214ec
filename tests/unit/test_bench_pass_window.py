"""The scale bench's reaper pass is timed from a turn of its own (issue 45): the turn the bench was in
when it set the pass up (the stream's figures, the settings, the memory driver's listing of the
stream's sandboxes cleared) is not counted as the pass's first turn. That work, not the pass, was
"the first pass's 36-38 ms hold" (docs/performance.md, "At scale"). Pinned by which turn the window
starts at, never by time."""

from __future__ import annotations

import asyncio

from sandbox_lanes_bench.loop_turns import GcPauses, LoopTurns
from sandbox_lanes_bench.scale_pod import fresh_marks


async def test_a_pass_window_does_not_count_the_turn_the_bench_set_it_up_in() -> None:
    with LoopTurns(asyncio.get_running_loop()) as turns, GcPauses() as gcs:
        await asyncio.sleep(0)  # from here on in a turn the probe records
        set_up_in = turns.mark()  # the index this turn gets when it ends
        mark, gc_mark = await fresh_marks(turns, gcs)
        assert mark > set_up_in, "the window's first turn is the one the bench set the pass up in"
        assert gc_mark == gcs.mark()
        await asyncio.sleep(0)
        assert len(turns.since(mark)) == 1  # the window's own first turn, recorded when it ended
