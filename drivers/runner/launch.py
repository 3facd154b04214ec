"""The runner launch contract shared by the image-starting drivers (upstream ``sandbox/runner-launch.ts``).

The runner image layer keeps a start script beside its own Node: ``/runner/bin/start``
clears the base image's NODE_OPTIONS/NODE_PATH and execs ``/runner/bin/node``. Both
entries are started through it by absolute path, as root with root's home (the runner
starts the agent as its own user).
"""

from __future__ import annotations

from typing import Final

RUNNER_START: Final = "/runner/bin/start"
RUNNER_NODE: Final = "/runner/bin/node"
RUNNER_MAIN: Final = "/runner/dist/main.js"
WAITER_MAIN: Final = "/runner/dist/attach/main.js"
RUNNER_UID: Final = 0
RUNNER_GID: Final = 0
RUNNER_HOME: Final = "/root"


def runner_command() -> list[str]:
    """A fresh list on every call, so a caller's mutation never leaks into the next sandbox."""
    return [RUNNER_START, RUNNER_MAIN]


def waiter_command() -> list[str]:
    return [RUNNER_START, WAITER_MAIN]
