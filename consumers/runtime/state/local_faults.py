"""What a failure of a local state database is, and the marker that tells a database lost its data.

RocksDB (through ``rocksdict``) raises a bare :class:`Exception` whose message starts with its
status ("Corruption: ...", "IO error: No space left on device ..."); the filesystem raises
:class:`OSError`. At the store's boundary both become a
:class:`~consumers.runtime.state.interface.StateStoreFault` with one of the bounded
:data:`~consumers.runtime.state.interface.REBUILD_REASONS`; any other exception (a bug) passes
through untouched.

The marker: a database whose ``MANIFEST`` is cut short can open as an empty database without a
word, which would look like a partition never owned here. So once a partition's database holds a
checkpoint, a small file of ours sits beside RocksDB's files; a database without a checkpoint next
to that file has lost its data (reported as ``corrupt``), not never had any.
"""

from __future__ import annotations

import contextlib
import errno
import json
from collections.abc import Iterator
from pathlib import Path

from consumers.runtime.state.interface import StateStoreFault

#: The marker's file name, inside the partition's database directory (RocksDB leaves it alone).
MARKER = "SANDBOX_LANES_CHECKPOINTED"

_BY_ERRNO = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EACCES: "unwritable",
    errno.EPERM: "unwritable",
    errno.EROFS: "unwritable",
    errno.ENOTDIR: "not_a_directory",
    errno.EEXIST: "not_a_directory",
}
#: Words of RocksDB's (and the OS's) messages, first match wins.
_BY_MESSAGE = (
    ("Corruption", "corrupt"),
    ("No space left", "disk_full"),
    ("Disk quota exceeded", "disk_full"),
    ("Permission denied", "unwritable"),
    ("Read-only file system", "unwritable"),
    ("Not a directory", "not_a_directory"),
    ("File exists", "not_a_directory"),
)


def is_database_error(exc: BaseException) -> bool:
    """A failure of the database or the disk under it (rocksdict raises bare ``Exception``)."""
    return type(exc) is Exception or isinstance(exc, OSError)


def reason_of(exc: BaseException, *, writing: bool) -> str:
    """The bounded reason of a database or disk failure."""
    if isinstance(exc, OSError) and exc.errno in _BY_ERRNO:
        return _BY_ERRNO[exc.errno]
    text = str(exc)
    for words, reason in _BY_MESSAGE:
        if words in text:
            return reason
    return "write_failed" if writing else "read_failed"


@contextlib.contextmanager
def guarded(partition: int, *, writing: bool) -> Iterator[None]:
    """Turn a database or disk failure inside the block into a :class:`StateStoreFault`."""
    try:
        yield
    except StateStoreFault:
        raise
    except Exception as exc:
        if not is_database_error(exc):
            raise
        raise StateStoreFault(partition, reason_of(exc, writing=writing), str(exc) or repr(exc)) from exc


def marked(path: Path) -> bool:
    """Whether the database at ``path`` held a checkpoint once."""
    return (path / MARKER).is_file()


def mark(path: Path, topic: str, partition: int) -> None:
    """Record that the database at ``path`` holds a checkpoint (once; it stays)."""
    marker = path / MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"topic": topic, "partition": partition}) + "\n")
