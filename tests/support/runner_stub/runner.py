"""Stand-in runner: records its environment and idles like a Temporal worker.

Started by the local-process driver with no arguments. It writes its full env
as JSON to ``$WORKSPACE_ROOT_DIR/runner-env.json`` (atomically), appends its pid
to ``starts.log`` there (one line per start), then sleeps until SIGTERM.

Knobs (through the driver's ``runner_env``):

* ``STUB_SPAWN_GRANDCHILD=1``: start a ``sleep`` in the same process group and
  record its pid in ``grandchild.pid``, so a test can show the whole group ends;
* ``STUB_IGNORE_TERM=1``: ignore SIGTERM, so only the driver's SIGKILL ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    workspace = Path(os.environ["WORKSPACE_ROOT_DIR"])
    workspace.mkdir(parents=True, exist_ok=True)
    tmp = workspace / f"runner-env.json.{os.getpid()}"
    tmp.write_text(json.dumps(dict(os.environ), sort_keys=True))
    with (workspace / "starts.log").open("a") as log:
        log.write(f"{os.getpid()}\n")
    if os.environ.get("STUB_SPAWN_GRANDCHILD") == "1":
        child = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
        (workspace / "grandchild.pid").write_text(str(child.pid))
    if os.environ.get("STUB_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The env file appears last, so a reader that sees it also sees the other files.
    os.replace(tmp, workspace / "runner-env.json")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
