"""The soak's heap columns: glibc's main thread's arena apart from the other threads', read from this
process's own ``malloc_info``, and jemalloc's totals in a process preloaded with it (the real
allocators, not recordings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_lanes_bench.c_heap import ArenaSplit, arena_split, malloc_totals, parse_malloc_info

MIB = 1024 * 1024
DEVTOOLS = Path(__file__).resolve().parents[2] / "devtools"

# malloc_info's layout (glibc 2.36, malloc/malloc.c __malloc_info), two arenas, sizes lists trimmed.
TWO_ARENAS = """<malloc version="1">
<heap nr="0">
<sizes>
  <size from="17" to="32" total="64" count="2"/>
  <unsorted from="1041" to="1041" total="1041" count="1"/>
</sizes>
<total type="fast" count="2" size="64"/>
<total type="rest" count="5" size="300000"/>
<system type="current" size="10000000"/>
<system type="max" size="12000000"/>
<aspace type="total" size="10000000"/>
<aspace type="mprotect" size="10000000"/>
</heap>
<heap nr="1">
<sizes>
</sizes>
<total type="fast" count="0" size="0"/>
<total type="rest" count="1" size="1000"/>
<system type="current" size="135168"/>
<system type="max" size="135168"/>
<aspace type="total" size="135168"/>
<aspace type="mprotect" size="135168"/>
<aspace type="subheaps" size="1"/>
</heap>
<total type="fast" count="2" size="64"/>
<total type="rest" count="6" size="301000"/>
<total type="mmap" count="3" size="3145728"/>
<system type="current" size="10135168"/>
<system type="max" size="12135168"/>
<aspace type="total" size="10135168"/>
<aspace type="mprotect" size="10135168"/>
</malloc>
"""


def test_each_arena_is_counted_once_and_the_process_totals_are_not_an_arena() -> None:
    split = parse_malloc_info(TWO_ARENAS)
    assert split == ArenaSplit(
        main_system=10_000_000, main_free=300_064, threads_system=135_168, threads_free=1000, thread_arenas=1
    )
    assert split.mib() == (round(9_699_936 / MIB, 2), round(300_064 / MIB, 2), round(134_168 / MIB, 2), 0.0)


def test_what_the_main_thread_keeps_shows_in_the_main_arena() -> None:
    before = arena_split()
    if before == ArenaSplit():
        pytest.fail("no malloc_info here: the soak's arena columns would be empty")
    # 48 KiB each: under glibc's mmap threshold (at least 128 KiB), so from the main thread's arena
    kept = [bytearray(48 * 1024) for _ in range(400)]
    after = arena_split()
    grown = (after.main_system - after.main_free) - (before.main_system - before.main_free)
    assert grown >= 15 * MIB, (before, after)
    assert malloc_totals()[0] >= grown / MIB
    del kept


JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2 (scripts/bootstrap.sh)


def test_under_jemalloc_the_totals_are_jemallocs() -> None:
    """A process on jemalloc (preloaded, as ``bench --soak-preload`` runs the soak's pod): the totals
    follow what it holds, and the arena split, glibc's, reads what glibc is left with."""
    if not Path(JEMALLOC).is_file():
        pytest.fail(f"{JEMALLOC} missing: scripts/bootstrap.sh installs libjemalloc2")
    code = (
        "import json\n"
        "from sandbox_lanes_bench.c_heap import arena_split, malloc_totals\n"
        "before = malloc_totals()\n"
        "kept = [bytearray(48 * 1024) for _ in range(400)]\n"
        "after = malloc_totals()\n"
        "print(json.dumps([before, after, arena_split().mib()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "LD_PRELOAD": JEMALLOC, "PYTHONPATH": str(DEVTOOLS)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    before, after, split = json.loads(out.stdout)
    assert after[0] - before[0] >= 15, (before, after)  # 400 x 48 KiB in use: 18.75 MiB
    assert split[0] < 1, split  # glibc's main arena: nothing of the 18.75 MiB
