"""The process's allocator told to give RocksDB's freed memtables back to the system.

RocksDB allocates a memtable in blocks of an eighth of its size (1 MiB here) with ``malloc``. glibc
serves a block that large by ``mmap`` and returns it on ``free`` only until its *dynamic* mmap
threshold has risen past it, which the first such free does: from then on the blocks come from the
heap, and a flushed memtable's blocks stay in the process as free heap that long-lived objects above
them keep from being trimmed. Measured in the two-hour soak (docs/performance.md, The soak): glibc's
free-but-kept bytes went from 4.0 to 22.5 MiB (first and last quarter medians) while the memtables
rose and fell; with the threshold fixed, 4.1 to 8.3 MiB in a 70-minute run beside it.
Fixing the threshold at glibc's default (128 KiB) turns the dynamic adjustment off: every memtable
block is mapped on its own and unmapped when its memtable is flushed.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Final

logger = logging.getLogger("sandbox_lanes.state")

#: glibc's ``mallopt`` parameter number for the mmap threshold (malloc.h).
M_MMAP_THRESHOLD: Final = -3
#: glibc's default threshold: set explicitly, it no longer moves.
MMAP_THRESHOLD_BYTES: Final = 128 * 1024

_done = False


def unmap_large_blocks() -> bool:
    """Fix glibc's mmap threshold (once per process); False where the C library is not glibc."""
    global _done
    if _done:
        return True
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl, macOS: their allocators return large blocks themselves
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1)
    if not _done:
        logger.warning("glibc refused a fixed mmap threshold: freed memtables may stay in the process")
    return _done
