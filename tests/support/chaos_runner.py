"""The chaos run's stand-in runner: like ``consumers.tools.stub_runner``, but some queues ignore SIGTERM.

The queues listed (one a line) in the file named by ``CHAOS_STUBBORN_FILE`` ignore SIGTERM, so the
driver's teardown outlasts ``SANDBOX_LANES_TEARDOWN_TIMEOUT_S``: a real ``SandboxTeardownFailed`` with
a real leaked process that only a later teardown (the reaper's SIGKILL after the grace) ends.
A runner lives at most ``CHAOS_RUNNER_MAX_S`` seconds (default 1800), so nothing outlives a run forever.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> int:
    stopping = False
    queue = os.environ.get("STIGMER_TASK_QUEUE", "")
    stubborn_file = os.environ.get("CHAOS_STUBBORN_FILE", "")
    stubborn = False
    if stubborn_file:
        try:
            stubborn = queue in Path(stubborn_file).read_text().split()
        except OSError:
            stubborn = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if stubborn else on_term)
    deadline = time.monotonic() + float(os.environ.get("CHAOS_RUNNER_MAX_S", "1800"))
    while not stopping and time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
