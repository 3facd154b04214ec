"""The C heap as its allocator sees it, for the soak's samples: glibc's totals (``mallinfo2``) and the
main thread's arena apart from the other threads' (``malloc_info``), or jemalloc's totals.

The split says whose allocations a rising heap holds: the main arena serves the thread that runs the
event loop (Python objects over 512 bytes, protobuf's and the codecs' buffers), the thread arenas
librdkafka's, RocksDB's and the executor's threads. Roughly: once glibc's arena limit is reached (8 per
core), a new thread is handed an existing arena, the main one among them. Where the C library is not
glibc (2.33+ for ``mallinfo2``) every figure is 0.

Under jemalloc (preloaded: ``bench --soak-preload``) the totals are jemalloc's own (``mallctl``): in use
(``stats.allocated``) and what it keeps beside that (``stats.resident`` less it: dirty pages not yet
purged, its metadata, the unused parts of its extents). glibc's arenas then hold next to nothing.
"""

from __future__ import annotations

import ctypes
import functools
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, its calls' types set once (the sampler runs every second in the measured process)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    if hasattr(libc, "malloc_info") and hasattr(libc, "open_memstream"):
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
        libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.fclose.argtypes = (ctypes.c_void_p,)
    return libc


@functools.cache
def _free() -> Any:
    """``free`` as the process resolves it, not glibc's own: the memory stream's buffer comes from
    whichever ``malloc`` the process runs on (another allocator preloaded takes glibc's internal calls
    too), and glibc's ``free`` of another allocator's block aborts the process."""
    free = ctypes.CDLL(None).free
    free.argtypes = (ctypes.c_void_p,)
    return free


@functools.cache
def _mallctl() -> Any:
    """jemalloc's ``mallctl`` where the process runs on it, else None (glibc has no such call)."""
    mallctl = getattr(ctypes.CDLL(None), "mallctl", None)
    if mallctl is None:
        return None
    mallctl.argtypes = (
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_void_p,
        ctypes.c_size_t,
    )
    mallctl.restype = ctypes.c_int
    return mallctl


def _jemalloc_totals(mallctl: Any) -> tuple[float, float]:
    epoch = ctypes.c_uint64(1)  # jemalloc's statistics are a snapshot, refreshed by writing the epoch
    mallctl(b"epoch", None, None, ctypes.byref(epoch), ctypes.sizeof(epoch))
    values = []
    for name in (b"stats.allocated", b"stats.resident"):
        value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if mallctl(name, ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return (0.0, 0.0)  # built without statistics
        values.append(value.value)
    allocated, resident = values
    return (round(allocated / MIB, 2), round(max(0, resident - allocated) / MIB, 2))


def malloc_totals() -> tuple[float, float]:
    """The C heap in MiB: (in use, including mmapped chunks; free but kept). glibc's from its arenas,
    jemalloc's from its statistics where the process runs on it. The RSS beyond both and beyond
    Python's own arenas is memory no allocator accounts for (stacks, libraries' own maps)."""
    mallctl = _mallctl()
    if mallctl is not None:
        return _jemalloc_totals(mallctl)
    call = getattr(_libc(), "mallinfo2", None)
    if call is None:  # not glibc 2.33+: the columns stay empty
        return (0.0, 0.0)
    info = call()
    return (round((info.uordblks + info.hblkhd) / MIB, 2), round(info.fordblks / MIB, 2))


@dataclass(frozen=True)
class ArenaSplit:
    """Bytes from the system and bytes free in them, the main arena apart from the threads' arenas
    (mmapped chunks, which belong to no arena, are in neither)."""

    main_system: int = 0
    main_free: int = 0
    threads_system: int = 0
    threads_free: int = 0
    thread_arenas: int = 0

    def mib(self) -> tuple[float, float, float, float]:
        """(main arena in use, main arena free, thread arenas in use, thread arenas free) in MiB."""
        return (
            round((self.main_system - self.main_free) / MIB, 2),
            round(self.main_free / MIB, 2),
            round((self.threads_system - self.threads_free) / MIB, 2),
            round(self.threads_free / MIB, 2),
        )


def parse_malloc_info(xml: str) -> ArenaSplit:
    """``malloc_info``'s XML: one ``<heap nr=N>`` per arena (0 is the main one), each with its free
    chunks' totals (``<total type="fast">``, ``<total type="rest">``) and the bytes it holds from the
    system (``<system type="current">``)."""
    main_system = main_free = threads_system = threads_free = arenas = 0
    for heap in ET.fromstring(xml).iter("heap"):
        totals = heap.findall("total")
        free = sum(int(t.get("size", "0")) for t in totals if t.get("type") in ("fast", "rest"))
        system = sum(int(s.get("size", "0")) for s in heap.findall("system") if s.get("type") == "current")
        if heap.get("nr") == "0":
            main_system, main_free = system, free
        else:
            threads_system += system
            threads_free += free
            arenas += 1
    return ArenaSplit(main_system, main_free, threads_system, threads_free, arenas)


def arena_split() -> ArenaSplit:
    """This process's arenas now, through ``malloc_info`` into a memory stream (it writes to a
    ``FILE *``); an empty split where the C library has no ``malloc_info``."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_info") or not hasattr(libc, "open_memstream"):
        return ArenaSplit()
    buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    if not stream:
        return ArenaSplit()
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # sets buffer and size
    try:
        xml = ctypes.string_at(buffer.value, size.value).decode() if buffer.value else ""
    finally:
        _free()(buffer)
    return parse_malloc_info(xml) if xml else ArenaSplit()
