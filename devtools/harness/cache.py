"""Where the test harness keeps what it fetches or builds: outside the repo, shared across clones."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """``$SANDBOX_LANES_CACHE``, else ``~/.cache/sandbox-lanes``."""
    override = os.environ.get("SANDBOX_LANES_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "sandbox-lanes"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock file, so two test runs never prepare the same cache entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
