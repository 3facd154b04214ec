"""Deterministic sandbox object names and labels (upstream ``sandbox/naming.ts``).

The name is the only key a driver needs: ensure/deprovision/probe are idempotent
because the same (scope, id) always maps to the same runtime object.
"""

from __future__ import annotations

import functools
import hashlib
import re
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
#: Which installation (a pod group: production, staging, ...) made the object; see ``DriverConfig``.
LABEL_INSTALLATION: Final = "stigmer.ai/installation"
MANAGED_BY_VALUE: Final = "stigmer-server"
#: A Kubernetes label value (the installation is one on every object): 1-63 characters, alphanumeric
#: at both ends, ``-``, ``_`` and ``.`` between.
_LABEL_VALUE: Final = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def valid_installation(value: str) -> str:
    """``value`` when it can be a label value (what an installation is everywhere), else ValueError."""
    if not _LABEL_VALUE.fullmatch(value):
        raise ValueError(
            f"installation {value!r} is not usable as a label value: 1-63 characters from a-z A-Z 0-9 "
            "- _ . beginning and ending with a letter or digit"
        )
    return value


@functools.lru_cache(maxsize=4096)
def sandbox_base_name(scope: SandboxScope, sandbox_id: str) -> str:
    """``sbx-<code>-<first 12 hex of sha256(id)>``: DNS-1123 safe for any id alphabet.

    Pure, so cached: an ensure and its later deprovision (and the driver's own calls) share one hash.
    """
    digest = hashlib.sha256(sandbox_id.encode("utf-8")).hexdigest()[:12]
    return f"sbx-{SCOPE_CODES[scope]}-{digest}"


def installation_labels(installation: str) -> dict[str, str]:
    """What marks an object as this installation's, also one that belongs to no sandbox (a warm pool)."""
    return {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_INSTALLATION: installation}


def sandbox_labels(scope: SandboxScope, sandbox_id: str, installation: str) -> dict[str, str]:
    """The four labels every managed runtime object carries (the reap filter)."""
    return {
        LABEL_MANAGED_BY: MANAGED_BY_VALUE,
        LABEL_INSTALLATION: installation,
        LABEL_SCOPE: scope,
        LABEL_SANDBOX_ID: sandbox_id,
    }


def managed_selector(installation: str) -> str:
    """The label selector of this installation's objects: every list a driver makes uses it."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY_VALUE},{LABEL_INSTALLATION}={installation}"


def is_installations(labels: Mapping[str, str] | None, installation: str) -> bool:
    """Managed by us and made by this installation (an object without the labels is nobody's here)."""
    labels = labels or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY_VALUE and labels.get(LABEL_INSTALLATION) == installation


def label_owner(labels: Mapping[str, str] | None) -> str | None:
    """The sandbox id an object's labels name as its owner; ``None`` when it is not one of ours."""
    labels = labels or {}
    if labels.get(LABEL_MANAGED_BY) != MANAGED_BY_VALUE:
        return None
    return labels.get(LABEL_SANDBOX_ID) or None


def is_owned_by(
    labels: Mapping[str, str] | None, scope: SandboxScope, sandbox_id: str, installation: str
) -> bool:
    """Does the object carry this sandbox's labels (managed by us, this installation, this id, this
    scope when set)?

    Every driver checks this before it fast-paths onto, wakes, writes into or deletes an object found
    under the sandbox's name: two ids can map to one name (48 bits of sha256), and two installations
    (a staging pod beside a production pod) can share a namespace or an engine.
    """
    labels = labels or {}
    return (
        label_owner(labels) == sandbox_id
        and labels.get(LABEL_SCOPE, scope) == scope
        and labels.get(LABEL_INSTALLATION) == installation
    )
