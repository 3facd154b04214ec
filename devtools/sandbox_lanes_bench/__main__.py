"""``python -m sandbox_lanes_bench`` = ``sandbox-lanes bench``."""

import sys

from consumers.tools.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
