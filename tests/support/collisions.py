"""A real pair of ids whose sandbox names collide, for the drivers' ownership tests.

Names are upstream's ``sbx-<code>-<first 12 hex of sha256(id)>``: 48 bits, so a birthday search
finds two ids with one name after about 2^24 tries. The pair below was found once by
:func:`find_colliding_ids` over ``exec-0``, ``exec-1``, ... (41,792,727 ids, 86 s of one core, about
2.5 GB; 2^24 ids hold a collision only about 39% of the time) and is kept as literals; the tests
assert it still collides under the project's own naming function. Run ``python -m tests.support.collisions``
to search again.
"""

from __future__ import annotations

import time
from typing import Final

from drivers.contract import SandboxScope
from drivers.naming import sandbox_base_name

#: Two execution ids with one sandbox name (``sbx-wfx-eb84182ae0bf`` in the workflow scope).
FIRST: Final = "exec-9636"
SECOND: Final = "exec-41792726"
#: The 12 hex both ids' sha256 start with.
SHARED_DIGEST: Final = "eb84182ae0bf"


def assert_collide(scope: SandboxScope, first: str = FIRST, second: str = SECOND) -> str:
    """The name both ids map to in ``scope``; fails unless they are distinct and share it."""
    name = sandbox_base_name(scope, first)
    assert first != second
    assert sandbox_base_name(scope, second) == name, (first, second, name)
    assert name.endswith(f"-{SHARED_DIGEST}")
    return name


def find_colliding_ids(prefix: str = "exec-", limit: int = 1 << 26) -> tuple[str, str] | None:
    """The first two of ``prefix0``, ``prefix1``, ... whose names collide, or ``None`` within ``limit``."""
    name = sandbox_base_name.__wrapped__  # the naming function itself, without its small cache
    seen: dict[str, int] = {}
    for i in range(limit):
        digest = name("workflow", f"{prefix}{i}")
        j = seen.setdefault(digest, i)
        if j != i:
            return f"{prefix}{j}", f"{prefix}{i}"
    return None


if __name__ == "__main__":
    started = time.monotonic()
    print(find_colliding_ids(), f"{time.monotonic() - started:.1f}s")
