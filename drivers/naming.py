"""Deterministic sandbox object names and labels (upstream ``sandbox/naming.ts``).

The name is the only key a driver needs: ensure/deprovision/probe are idempotent
because the same (scope, id) always maps to the same runtime object.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Final

from drivers.contract import SandboxScope

SCOPE_CODES: Final[dict[SandboxScope, str]] = {
    "session": "ses",
    "workflow": "wfx",
    "connect": "mcp",
}

LABEL_MANAGED_BY: Final = "stigmer.ai/managed-by"
LABEL_SCOPE: Final = "stigmer.ai/scope"
LABEL_SANDBOX_ID: Final = "stigmer.ai/sandbox-id"
MANAGED_BY_VALUE: Final = "stigmer-server"


@functools.lru_cache(maxsize=4096)
def sandbox_base_name(scope: SandboxScope, sandbox_id: str) -> str:
    """``sbx-<code>-<first 12 hex of sha256(id)>``: DNS-1123 safe for any id alphabet.

    Pure, so cached: an ensure and its later deprovision (and the driver's own calls) share one hash.
    """
    digest = hashlib.sha256(sandbox_id.encode("utf-8")).hexdigest()[:12]
    return f"sbx-{SCOPE_CODES[scope]}-{digest}"


def sandbox_labels(scope: SandboxScope, sandbox_id: str) -> dict[str, str]:
    """The three labels every managed runtime object carries (the reap filter)."""
    return {
        LABEL_MANAGED_BY: MANAGED_BY_VALUE,
        LABEL_SCOPE: scope,
        LABEL_SANDBOX_ID: sandbox_id,
    }


def label_owner(labels: Mapping[str, str] | None) -> str | None:
    """The sandbox id an object's labels name as its owner; ``None`` when it is not one of ours."""
    labels = labels or {}
    if labels.get(LABEL_MANAGED_BY) != MANAGED_BY_VALUE:
        return None
    return labels.get(LABEL_SANDBOX_ID) or None


def is_owned_by(labels: Mapping[str, str] | None, scope: SandboxScope, sandbox_id: str) -> bool:
    """Does the object carry this sandbox's labels (managed by us, this id, this scope when set)?

    Every driver checks this before it fast-paths onto, wakes, writes into or deletes an object found
    under the sandbox's name: two ids can map to one name (48 bits of sha256).
    """
    labels = labels or {}
    return label_owner(labels) == sandbox_id and labels.get(LABEL_SCOPE, scope) == scope
