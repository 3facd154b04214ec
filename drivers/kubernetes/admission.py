"""Has the engine admitted a sandbox's pod, or refused it for quota? Pure reads of API objects.

A ``ResourceQuota`` refuses at admission with HTTP 403 and ``exceeded quota: <name>, requested: ...``,
but only the object being created: a quota on ``count/deployments.apps`` (or secrets, claims) refuses
the driver's own create; a quota on pods, CPU or memory lets the Deployment in and refuses its
ReplicaSet's pod, which the ReplicaSet reports as the condition ``ReplicaFailure`` (reason
``FailedCreate``, the quota's message) and the Deployment controller copies onto the Deployment.
Both are the engine saying "full" (:class:`~drivers.contract.CapacityRefused`), not a fault.
"""

from __future__ import annotations

from typing import Any, Final

#: The words of the API server's quota admission in every refusal it makes.
QUOTA_REFUSAL: Final = "exceeded quota"
REPLICA_FAILURE: Final = "ReplicaFailure"


def quota_refusal(status: int, message: str) -> bool:
    """A create (or write) refused by a ``ResourceQuota``."""
    return status == 403 and QUOTA_REFUSAL in message


def _conditions(dep: Any) -> list[Any]:
    status = getattr(dep, "status", None)
    return list(getattr(status, "conditions", None) or [])


def pod_refusal(dep: Any) -> str | None:
    """The quota's message when the Deployment's pod was refused for quota (``ReplicaFailure``)."""
    for cond in _conditions(dep):
        if getattr(cond, "type", None) != REPLICA_FAILURE or getattr(cond, "status", None) != "True":
            continue
        message = str(getattr(cond, "message", "") or "")
        if QUOTA_REFUSAL in message:
            return message
    return None


def pod_admitted(dep: Any) -> bool:
    """Its ReplicaSet has a pod (``status.replicas`` counts the pods made, running or not)."""
    status = getattr(dep, "status", None)
    return int(getattr(status, "replicas", None) or 0) >= 1
