"""A stand-in runner for the demo, the compose pod and the local-process tests: it "polls" its queue
until SIGTERM.

It prints the queue it serves and whether it received a token (never the token),
then sleeps; SIGTERM ends it cleanly, as the real runner's Temporal worker drains.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType


def main() -> int:
    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    queue = os.environ.get("STIGMER_TASK_QUEUE", "")
    token = "yes" if os.environ.get("STIGMER_TOKEN") else "no"
    # One write of the whole line: print() writes the text and its newline apart, and a pod that
    # shares this stderr could land its own log line between the two.
    os.write(2, f"[stub-runner pid={os.getpid()}] polling {queue} (token: {token})\n".encode())
    while not stopping:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
