"""The RocksDB store fixes glibc's mmap threshold (docs/performance.md, The soak): a memtable's 1 MiB
blocks are mapped on their own and unmapped when freed, however many were freed before. Checked in a
process of its own, with glibc's own counters (``mallinfo2``: bytes in mapped chunks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_PROBE = textwrap.dedent(
    """
    import ctypes, sys
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    if sys.argv[1] == "store":
        from consumers.runtime.state.rocksdb import RocksDBStore
        RocksDBStore("state", directory=sys.argv[2]).close()
    # a first block freed: glibc's dynamic threshold rises past 1 MiB unless it was fixed
    libc.free(libc.malloc(1 << 20))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(1 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    print(mapped >= (1 << 20))
    """
)


def test_a_memtable_block_is_mapped_after_one_was_freed(tmp_path: Path) -> None:
    def probe(mode: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, mode, str(tmp_path / mode)],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        return out.stdout.strip()

    # glibc as it comes: the second block comes from the heap, where its free keeps it
    assert probe("plain") == "False"
    # with the store opened: mapped, and unmapped on free
    assert probe("store") == "True"
