"""Has the agent-sandbox controller made a Sandbox's pod, or was the pod refused for quota? Pure reads.

The controller (kubernetes-sigs/agent-sandbox v1.0.1, ``controllers/sandbox_controller.go``) creates
the pod itself; when the API server refuses it (a ``ResourceQuota`` on pods, CPU or memory:
``pods "<name>" is forbidden: exceeded quota: ...``) the reconcile fails and the Sandbox's ``Ready``
condition says so: status ``False``, reason ``ReconcilerError``, message ``Error seen: <the API
server's words>``, ``observedGeneration`` the Sandbox's generation. Once a pod exists the message
reads ``Pod exists with phase: ...`` / ``Pod is Running ...`` (or the condition is ``True``); without
one, ``Pod does not exist``. The controller's own retries back off exponentially (per key, to
minutes), so the driver deletes a refused Sandbox and the pod's next ensure creates a fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from drivers.kubernetes.admission import QUOTA_REFUSAL

RECONCILER_ERROR: Final = "ReconcilerError"
NO_POD: Final = "Pod does not exist"

Admission = Literal["admitted", "refused", "pending"]


def _ready(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return cond
    return None


def sandbox_admission(obj: Mapping[str, Any]) -> tuple[Admission, str]:
    """``admitted`` (a pod exists), ``refused`` (its pod refused for quota; the message) or ``pending``
    (the controller has not reconciled this generation yet, or no pod yet)."""
    cond = _ready(obj)
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    if cond is None or int(cond.get("observedGeneration") or 0) < generation:
        return "pending", ""
    message = str(cond.get("message") or "")
    if cond.get("status") == "True":
        return "admitted", message
    if cond.get("reason") == RECONCILER_ERROR:
        return ("refused", message) if QUOTA_REFUSAL in message else ("pending", message)
    if message.startswith("Pod exists") or message.startswith("Pod is"):
        return "admitted", message
    return "pending", message
