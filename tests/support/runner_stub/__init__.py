"""A stand-in runner program for the local-process driver tests (see ``runner.py``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

RUNNER_STUB = Path(__file__).with_name("runner.py")
ENV_FILE = "runner-env.json"
STARTS_FILE = "starts.log"
GRANDCHILD_FILE = "grandchild.pid"


def runner_command() -> str:
    """``runner_command`` for DriverConfig: this interpreter running the stub, no arguments."""
    return shlex.join([sys.executable, str(RUNNER_STUB)])
