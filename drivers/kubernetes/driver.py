"""The ``kubernetes`` driver, tier 3 (upstream ``sandbox/kubernetes.ts``, Era C).

One Deployment per sandbox, all in one namespace (``config.kubernetes_namespace``),
through the official ``kubernetes`` Python client. The client is blocking, so every
call runs in ``asyncio.to_thread``.

Objects per sandbox (base name from :func:`drivers.naming.sandbox_base_name`), each
carrying the three stigmer labels:

* Secret ``<base>-env`` (Opaque): runner secrets, then the Temporal connection
  settings, then ``STIGMER_TOKEN`` when a token was minted. It always exists (empty
  when token-less) so cleanup is uniform.
* PVC ``<base>-workspace`` for the persistent scopes (session, workflow) only;
  connect sandboxes mount an ``emptyDir``.
* Deployment ``<base>``: replicas 1, ``Recreate``, one ``runner`` container.

State machine (spec 5.3): ``ensure`` reads the Deployment's ``spec.replicas``;
absent → Secret, PVC, Deployment (in that order); 0 → scale to 1 through the
``scale`` subresource with nothing re-applied; ≥1 → fast path (the pod keeps the
token it booted with). ``deprovision`` deletes Deployment, Secret, PVC; a 404 is
success. No readiness wait anywhere; after a create or a scale-up the ensure waits (up to
``admission_wait_seconds``) only for the engine to make the pod or refuse it for quota.

Engine quota is capacity (``drivers.kubernetes.admission``): a write refused 403 ``exceeded quota``
and a Deployment whose pod a ``ResourceQuota`` refused (``ReplicaFailure``) raise
:class:`~drivers.contract.CapacityRefused`, which the pod waits out; a refused Deployment is deleted
first, so it holds nothing and the next ensure is a fresh create.

Ownership (names are 48 bits of sha256, so two ids can share one; two installations can share a
namespace): every object carries the ``stigmer.ai/sandbox-id`` and ``stigmer.ai/installation``
labels, and the driver reads them before it acts on an object it found under the sandbox's name:
the Deployment before the fast path or the scale-up, the Secret before writing it, the claim when its
create answers 409, and each of the three before deleting it. Another sandbox's object (another id's,
another installation's, or one without the labels) fails the ensure with
:class:`~drivers.contract.SandboxCollision` (naming the object, its owner's id and installation) and
is never written; a deprovision leaves it alone and logs which object it left (``LOG_LEFT_ALONE``).
The Secret's labels are read without the ``get`` verb and without its data: a dry-run JSON Patch (a
lone ``test`` op) answered as ``PartialObjectMetadata``; the claim's with ``get``.

How objects are written — every write is conditional on what was checked (issue 34):

* An absent object is **created** (Secret, claim, Deployment), never applied: a create cannot take
  over an object made in between. Its 409 is judged again: this sandbox's (a racing ensure of the
  same id) is taken as it is; another's is a ``SandboxCollision``, and the Secret and claim this
  ensure created are deleted again by uid. So two colliding ids that both found nothing end with one
  owner and one collision.
* An existing Secret of this sandbox is rewritten by one **JSON Patch** that tests its uid,
  ``sandbox-id`` and ``installation`` and replaces the whole ``data`` (a key dropped since, say a
  token-less repair, goes). The scale-up is a JSON Patch of the Deployment with the same tests.
  A failed test (a 422 without causes: the object changed since the read) makes the ensure read and
  judge again, up to ``WRITE_ATTEMPTS`` times.
* The PVC is **created, and kept on 409** when it is this sandbox's (exactly upstream): a claim is
  never replaced, the surviving workspace is the point of the repair arm.
* Deletes carry the checked object's uid as a precondition, so a replacement created in between is
  never deleted; Deployments are deleted with ``propagationPolicy=Background``.

RBAC verbs the driver needs (see ``compose/kubernetes/overlays/kubernetes/role.yaml``): deployments
get/list/create/patch/delete, secrets create/patch/delete, persistentvolumeclaims get/create/delete.

Every API failure becomes :class:`~drivers.contract.SandboxError` carrying the API
server's own ``message`` (for example ``... is forbidden: User ... cannot ...`` or
``exceeded quota: ...``), with any secret value scrubbed; the bearer token is never
part of it.

Client configuration: ``options["kubeconfig"]`` (+ optional
``options["kubeconfig_context"]``) when set, else the in-cluster service account,
else the default kubeconfig (``$KUBECONFIG`` / ``~/.kube/config``).

Options (``config.options``): ``kubeconfig``, ``kubeconfig_context``,
``storage_size`` (default ``10Gi``), ``storage_class`` (default: the cluster's),
``cpu_request`` / ``memory_request`` / ``cpu_limit`` / ``memory_limit`` (defaults
``500m`` / ``512Mi`` / ``2`` / ``2Gi``), ``request_timeout`` seconds (default 30),
``max_pool_size`` (default 32: connections kept to the API server; below the pod's driver
concurrency, a burst opens and throws away connections), ``admission_wait_seconds`` (default 10;
0 = off: a pod refused for quota then goes unseen).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from drivers.contract import (
    SCOPES,
    CapacityRefused,
    DriverConfig,
    ManagedSandbox,
    SandboxCollision,
    SandboxEnvironment,
    SandboxError,
    SandboxProbeState,
    SandboxScope,
    ScopedMethods,
)
from drivers.kubernetes.admission import pod_admitted, pod_refusal, quota_refusal
from drivers.kubernetes.manifests import (
    PERSISTENT_SCOPES,
    deployment_manifest,
    pvc_manifest,
    pvc_name,
    runner_env,
    secret_manifest,
    secret_name,
)
from drivers.naming import (
    LABEL_INSTALLATION,
    LABEL_SANDBOX_ID,
    LABEL_SCOPE,
    is_owned_by,
    label_owner,
    managed_selector,
    sandbox_base_name,
)
from drivers.runner.env import scrub
from resilience.backoff import Backoff

# The config loaders carry no annotations; bind them as Any for strict typing.
_load_kube_config: Any = k8s_config.load_kube_config
_load_incluster_config: Any = k8s_config.load_incluster_config

DRIVER_NAME: Final = "kubernetes"
FIELD_MANAGER: Final = "sandbox-lanes"
APPLY_CONTENT_TYPE: Final = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE: Final = "application/merge-patch+json"
JSON_PATCH_CONTENT_TYPE: Final = "application/json-patch+json"
#: Ask for an object's metadata only (labels, uid): a Secret's data never crosses the wire.
PARTIAL_METADATA_ACCEPT: Final = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
LOG_LEFT_ALONE: Final = "sandbox deprovision left another sandbox's object alone"
#: How often a conditional write is tried again after the object changed under it (a 409 on a
#: precondition, a failed ``test`` op): each try re-reads and judges the object afresh.
WRITE_ATTEMPTS: Final = 5


def pointer(path: str) -> str:
    """A JSON Pointer segment (``~`` and ``/`` escaped)."""
    return path.replace("~", "~0").replace("/", "~1")


def guard_ops(uid: str, sandbox_id: str | None, installation: str) -> list[dict[str, Any]]:
    """JSON Patch ``test`` ops: the patch applies only to the very object checked (its uid), still
    labelled with this sandbox's id (when it has one) and this installation."""
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": uid}] if uid else []
    if sandbox_id is not None:
        ops.append(
            {"op": "test", "path": "/metadata/labels/" + pointer(LABEL_SANDBOX_ID), "value": sandbox_id}
        )
    ops.append(
        {"op": "test", "path": "/metadata/labels/" + pointer(LABEL_INSTALLATION), "value": installation}
    )
    return ops


#: What the API server answers (422, no causes) when a JSON Patch cannot be applied, as when a ``test``
#: op fails; an object the patch makes invalid is a 422 naming the object and its causes instead.
PATCH_NOT_APPLIED: Final = "the server rejected our request due to an error in our request"


def failed_test(exc: ApiException) -> bool:
    """A JSON Patch refused because a ``test`` op failed (the object changed since it was checked)."""
    return _status(exc) == 422 and api_error_message(exc) == PATCH_NOT_APPLIED


def backend_endpoint_required(driver: str) -> str:
    return (
        f"sandbox provisioner '{driver}' requires STIGMER_SANDBOX_BACKEND_ENDPOINT"
        " — a pod cannot reach the server on this process's localhost"
    )


def temporal_address_required(driver: str) -> str:
    return (
        f"sandbox provisioner '{driver}' requires STIGMER_SANDBOX_TEMPORAL_ADDRESS (or TEMPORAL_HOST_PORT)"
        " reachable from inside the cluster"
    )


BACKEND_ENDPOINT_REQUIRED: Final = backend_endpoint_required(DRIVER_NAME)
TEMPORAL_ADDRESS_REQUIRED: Final = temporal_address_required(DRIVER_NAME)

_T = TypeVar("_T")


class Found:
    """An object found under a sandbox's name: what the ownership check and a guarded write or
    delete need (its labels, uid and resourceVersion as read)."""

    def __init__(
        self,
        kind: str,
        where: str,
        labels: Mapping[str, str] | None,
        uid: str,
        resource_version: str = "",
    ) -> None:
        self.kind = kind
        self.where = where
        self.labels: Mapping[str, str] = labels or {}
        self.uid = uid
        self.resource_version = resource_version

    @property
    def name(self) -> str:
        return self.where.split("/", 1)[1]

    @property
    def owner(self) -> str | None:
        return label_owner(self.labels)

    @property
    def installation(self) -> str | None:
        return self.labels.get(LABEL_INSTALLATION) or None

    def owned_by(self, scope: SandboxScope, sandbox_id: str, installation: str) -> bool:
        return is_owned_by(self.labels, scope, sandbox_id, installation)

    def describe(self, installation: str | None = None) -> str:
        owner = self.owner
        held = f"{self.labels.get(LABEL_SCOPE, '?')} '{owner}'" if owner is not None else "no sandbox of ours"
        if owner is not None and installation is not None and self.installation != installation:
            held += f" of installation '{self.installation}'" if self.installation else " of no installation"
        return f"{self.kind} {self.where} (owned by {held})"


def api_error_message(exc: ApiException) -> str:
    """The API server's own ``message`` from a Status body, else the HTTP reason."""
    body = getattr(exc, "body", None)
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str) and parsed["message"]:
            return str(parsed["message"])
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else "no message"


def _status(exc: ApiException) -> int:
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else 0


def _replicas(dep: Any) -> int:
    """A Deployment's ``spec.replicas`` (a missing value counts as 0)."""
    replicas = dep.spec.replicas if dep.spec is not None else None
    return int(replicas or 0)


# --------------------------------------------------------------------------- the driver


class KubernetesProvisioner(ScopedMethods):
    """Deployment-per-sandbox driver. Safe under concurrency: every write is idempotent."""

    #: Deployments per list request in :meth:`list_managed` (pages are followed).
    list_page_size: int = 500

    def __init__(self, config: DriverConfig, logger: logging.Logger, api_client: Any) -> None:
        self._config = config
        self._logger = logger
        self._api_client = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._apps = k8s.AppsV1Api(api_client)
        self._ns = config.kubernetes_namespace
        self._installation = config.installation
        self._selector = managed_selector(config.installation)
        timeout = float(config.options.get("request_timeout") or 30)
        self._timeout = timeout
        self.admission_wait_s = admission_wait_seconds(config.options)

    @property
    def driver_name(self) -> str:
        return DRIVER_NAME

    @property
    def namespace(self) -> str:
        return self._ns

    @property
    def installation(self) -> str:
        return self._installation

    @property
    def selector(self) -> str:
        """This installation's label selector: every list the driver makes."""
        return self._selector

    # -- error mapping
    def _redact(self, message: str, env: SandboxEnvironment | None = None) -> str:
        """Scrub every secret value (and its base64 form) from a server or transport message."""
        secrets = runner_env(self._config, env or SandboxEnvironment(task_queue="")).secret_values()
        encoded = [base64.b64encode(v.encode("utf-8")).decode("ascii") for v in secrets]
        return scrub(message, [*secrets, *encoded])

    async def _call(
        self,
        action: str,
        fn: Callable[..., _T],
        *args: Any,
        env: SandboxEnvironment | None = None,
        tolerate: frozenset[int] = frozenset(),
        **kwargs: Any,
    ) -> _T | None:
        """Run one blocking client call in a thread; map failures to SandboxError.

        A status listed in ``tolerate`` returns ``None`` instead of raising.
        """
        kwargs.setdefault("_request_timeout", self._timeout)
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            if _status(exc) in tolerate:
                return None
            raise self.failure(action, exc, env) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            message = self._redact(f"{type(exc).__name__}: {exc}", env)
            raise SandboxError(f"{self.driver_name} {action} failed: {message}") from None

    def failure(self, action: str, exc: ApiException, env: SandboxEnvironment | None = None) -> SandboxError:
        """The API server's refusal as a SandboxError: its own message, secrets scrubbed."""
        message = self._redact(api_error_message(exc), env)
        text = f"{self.driver_name} {action} failed (HTTP {_status(exc)}): {message}"
        # A ResourceQuota's refusal is the engine being full, not a fault: the pod waits it out.
        return CapacityRefused(text) if quota_refusal(_status(exc), message) else SandboxError(text)

    # -- ownership
    def collision(self, found: Found, name: str, scope: SandboxScope, sandbox_id: str) -> SandboxCollision:
        return SandboxCollision(
            self.driver_name,
            found.kind,
            found.where,
            name,
            scope,
            sandbox_id,
            found.owner,
            found.labels.get(LABEL_SCOPE),
            found.installation,
            self._installation,
        )

    def owns(self, found: Found, scope: SandboxScope, sandbox_id: str) -> bool:
        """Is ``found`` this sandbox's, made by this installation?"""
        return found.owned_by(scope, sandbox_id, self._installation)

    def check_owner(self, found: Found | None, name: str, scope: SandboxScope, sandbox_id: str) -> None:
        """Raise :class:`SandboxCollision` when ``found`` is another sandbox's object (another id's,
        another installation's, or one without our labels)."""
        if found is not None and not self.owns(found, scope, sandbox_id):
            raise self.collision(found, name, scope, sandbox_id)

    def guard(self, found: Found, sandbox_id: str | None) -> list[dict[str, Any]]:
        """The ``test`` ops that make a JSON Patch conditional on ``found`` as it was checked."""
        return guard_ops(found.uid, sandbox_id, self._installation)

    def left_alone(self, found: Found, scope: SandboxScope, sandbox_id: str) -> None:
        self._logger.warning(
            f"{self.driver_name} {LOG_LEFT_ALONE}",
            extra={
                "scope": scope,
                "id": sandbox_id,
                "kind": found.kind,
                "object": found.where,
                "ownerId": found.owner,
                "ownerInstallation": found.installation,
                "leftAlone": found.describe(self._installation),
            },
        )

    async def _metadata(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn``'s answer as ``PartialObjectMetadata`` (a JSON dict), or ``None`` on 404."""

        def fetch(*a: Any, **kw: Any) -> Any:
            resp = fn(*a, _preload_content=False, _headers={"Accept": PARTIAL_METADATA_ACCEPT}, **kw)
            try:
                return json.loads(resp.data)
            finally:
                resp.release_conn()

        return await self._call(action, fetch, *args, tolerate=frozenset({404}), **kwargs)

    async def find(self, kind: str, name: str) -> Found | None:
        """The labels and uid of the Secret or claim named ``name``; ``None`` when there is none."""
        where = f"{self._ns}/{name}"
        if kind == "Secret":
            # Read with the verb the driver has (patch), dry-run, answered as metadata only: no
            # write, no secret value. The lone op tests a field every object has.
            meta = await self._metadata(
                f"read Secret {where}",
                self._core.patch_namespaced_secret,
                name,
                self._ns,
                [{"op": "test", "path": "/metadata/name", "value": name}],
                dry_run="All",
                _content_type=JSON_PATCH_CONTENT_TYPE,
            )
        elif kind == "PersistentVolumeClaim":
            meta = await self._metadata(
                f"read PersistentVolumeClaim {where}",
                self._core.read_namespaced_persistent_volume_claim,
                name,
                self._ns,
            )
        else:
            raise ValueError(f"no ownership read for {kind}")
        if not isinstance(meta, dict):
            return None
        m = meta.get("metadata") or {}
        return Found(kind, where, m.get("labels"), str(m.get("uid", "")), str(m.get("resourceVersion", "")))

    # -- gateway
    async def read_deployment(self, name: str) -> Any:
        """The Deployment, or ``None`` on 404."""
        return await self._call(
            f"read Deployment {self._ns}/{name}",
            self._apps.read_namespaced_deployment,
            name,
            self._ns,
            tolerate=frozenset({404}),
        )

    def _found_deployment(self, dep: Any, name: str) -> Found:
        meta = dep.metadata
        labels = meta.labels if meta is not None else None
        uid = str(meta.uid or "") if meta is not None else ""
        version = str(meta.resource_version or "") if meta is not None else ""
        return Found("Deployment", f"{self._ns}/{name}", labels, uid, version)

    async def deployment_replicas(self, name: str) -> int | None:
        """``None`` on 404; ``spec.replicas`` (a missing value counts as 0)."""
        dep = await self.read_deployment(name)
        return None if dep is None else _replicas(dep)

    async def write_secret(
        self, manifest: dict[str, Any], scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> tuple[str, bool]:
        """Write the sandbox's Secret only where it is absent or this sandbox's; (its uid, created).

        Absent: created (a create never takes over anything: a 409 means another writer won, and the
        object is judged again). This sandbox's: one JSON Patch that tests the uid and labels it was
        checked with, then replaces the whole ``data`` (a key dropped since, say a token-less repair,
        goes) and the owner references; changed in between, it is judged again. Another's:
        :class:`SandboxCollision`, nothing written.
        """
        name = manifest["metadata"]["name"]
        where = f"{self._ns}/{name}"
        for _ in range(WRITE_ATTEMPTS):
            found = await self.find("Secret", name)
            self.check_owner(found, sandbox_base_name(scope, sandbox_id), scope, sandbox_id)
            if found is None:
                created = await self._call(
                    f"create Secret {where}",
                    self._core.create_namespaced_secret,
                    self._ns,
                    manifest,
                    env=env,
                    field_manager=FIELD_MANAGER,
                    tolerate=frozenset({409}),
                )
                if created is not None:
                    return str(getattr(created.metadata, "uid", "") or ""), True
                continue
            ops = [
                *self.guard(found, sandbox_id),
                {"op": "add", "path": "/data", "value": manifest.get("data") or {}},
            ]
            refs = manifest["metadata"].get("ownerReferences")
            if refs is not None:
                ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": refs})
            if await self.json_patch(
                f"write Secret {where}", self._core.patch_namespaced_secret, name, self._ns, ops, env=env
            ):
                return found.uid, False
        raise SandboxError(f"{self.driver_name} Secret {where} kept changing while an ensure wrote it")

    async def _create_deployment(self, manifest: dict[str, Any], env: SandboxEnvironment) -> Any:
        """Create the Deployment; ``None`` when one with the name exists (409: judged by the caller)."""
        name = manifest["metadata"]["name"]
        return await self._call(
            f"create Deployment {self._ns}/{name}",
            self._apps.create_namespaced_deployment,
            self._ns,
            manifest,
            env=env,
            field_manager=FIELD_MANAGER,
            tolerate=frozenset({409}),
        )

    async def _apply_pvc(self, manifest: dict[str, Any]) -> Any:
        """Create the claim; on 409 keep the existing one. The created claim, else ``None``."""
        name = manifest["metadata"]["name"]
        return await self._call(
            f"create PersistentVolumeClaim {self._ns}/{name}",
            self._core.create_namespaced_persistent_volume_claim,
            self._ns,
            manifest,
            field_manager=FIELD_MANAGER,
            tolerate=frozenset({409}),
        )

    async def json_patch(
        self, action: str, fn: Callable[..., Any], *args: Any, env: SandboxEnvironment | None = None
    ) -> bool:
        """A JSON Patch carrying its own ``test`` ops; False when the object is gone (404) or a test
        failed (it changed since it was checked): the caller judges it again."""
        try:
            await asyncio.to_thread(
                fn,
                *args,
                field_manager=FIELD_MANAGER,
                _content_type=JSON_PATCH_CONTENT_TYPE,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            if _status(exc) == 404 or failed_test(exc):
                return False
            raise self.failure(action, exc, env) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            message = self._redact(f"{type(exc).__name__}: {exc}", env)
            raise SandboxError(f"{self.driver_name} {action} failed: {message}") from None
        return True

    async def _scale_up(self, found: Found, sandbox_id: str) -> bool:
        """One replica, by a JSON Patch that tests the checked Deployment's uid and labels first.
        False when it vanished or changed since it was read."""
        return await self.json_patch(
            f"scale Deployment {found.where}",
            self._apps.patch_namespaced_deployment,
            found.name,
            self._ns,
            [*self.guard(found, sandbox_id), {"op": "add", "path": "/spec/replicas", "value": 1}],
        )

    async def _delete(self, kind: str, name: str, uid: str = "") -> None:
        """Delete ``name``; with ``uid``, only that very object (a 409: it was replaced meanwhile)."""
        if kind == "Deployment":
            fn: Callable[..., Any] = self._apps.delete_namespaced_deployment
            extra: dict[str, Any] = {"propagation_policy": "Background"}
        elif kind == "Secret":
            fn, extra = self._core.delete_namespaced_secret, {}
        else:
            fn, extra = self._core.delete_namespaced_persistent_volume_claim, {}
        if uid:
            extra["body"] = {"preconditions": {"uid": uid}}
        await self._call(
            f"delete {kind} {self._ns}/{name}", fn, name, self._ns, tolerate=frozenset({404, 409}), **extra
        )

    # -- contract
    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        base = sandbox_base_name(scope, sandbox_id)
        for _ in range(WRITE_ATTEMPTS):
            dep = await self.read_deployment(base)
            if dep is None:
                if await self._provision(scope, sandbox_id, env):
                    return "running"  # the probe's mapping: one desired replica is `running`
                continue  # a Deployment appeared under the name meanwhile: judged again
            found = self._found_deployment(dep, base)
            # another sandbox's Deployment is never fast-pathed onto nor scaled
            self.check_owner(found, base, scope, sandbox_id)
            if _replicas(dep) >= 1:
                return "running"  # fast path: nothing applied, the pod keeps the token it booted with
            if await self._scale_up(found, sandbox_id):
                await self.await_admission(base, found.uid)
                self._logger.info(
                    "Kubernetes sandbox scaled up",
                    extra={"scope": scope, "id": sandbox_id, "deployment": base},
                )
                return "running"
            # gone or changed since the read: judged again
        raise SandboxError(f"{self.driver_name} Deployment {self._ns}/{base} kept changing under the ensure")

    async def _provision(self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment) -> bool:
        """Secret, claim, Deployment; False when a Deployment appeared under the name meanwhile (the
        caller judges it). Each object is created, or written only when it is this sandbox's: two
        colliding ids that both found nothing end with one owner and one :class:`SandboxCollision`."""
        base = sandbox_base_name(scope, sandbox_id)
        secret_uid, _ = await self.write_secret(
            secret_manifest(self._config, scope, sandbox_id, env), scope, sandbox_id, env
        )
        claim_uid = ""
        if scope in PERSISTENT_SCOPES:
            created = await self._apply_pvc(pvc_manifest(self._config, scope, sandbox_id))
            if created is not None:
                claim_uid = str(getattr(getattr(created, "metadata", None), "uid", "") or "")
            else:
                # The claim exists: kept when it is this sandbox's (the repair arm's workspace), never
                # mounted when it is another's. The Secret this ensure just wrote goes again.
                claim = await self.find("PersistentVolumeClaim", pvc_name(base))
                if claim is not None and not self.owns(claim, scope, sandbox_id):
                    await self._undo(secret_uid, "", base)
                    raise self.collision(claim, base, scope, sandbox_id)
        created_dep = await self._create_deployment(
            deployment_manifest(self._config, scope, sandbox_id, env), env
        )
        if created_dep is None:
            dep = await self.read_deployment(base)
            if dep is not None and not self.owns(self._found_deployment(dep, base), scope, sandbox_id):
                # Another sandbox's create won the race: it keeps the name; what this one made goes.
                await self._undo(secret_uid, claim_uid, base)
                raise self.collision(self._found_deployment(dep, base), base, scope, sandbox_id)
            return False
        await self.await_admission(base, str(getattr(created_dep.metadata, "uid", "") or ""), env)
        self._logger.info(
            "Kubernetes sandbox provisioned",
            extra={
                "scope": scope,
                "id": sandbox_id,
                "deployment": base,
                "taskQueue": env.task_queue,
            },
        )
        return True

    async def await_admission(self, base: str, uid: str, env: SandboxEnvironment | None = None) -> None:
        """Wait (up to ``admission_wait_s``) until the Deployment's ReplicaSet has made its pod, or
        raise :class:`CapacityRefused` when a ``ResourceQuota`` refused that pod (``ReplicaFailure``).

        Not a readiness wait: a pod that exists (pending, pulling, running) is admitted. A refused
        Deployment is deleted first (by uid), so it holds nothing and the next ensure is a fresh
        create: the ReplicaSet's own retries back off exponentially (to minutes), a new one tries at
        once. Neither seen within the wait (a slow or absent controller): the ensure goes on as it
        always did. A Deployment gone or replaced meanwhile is not this ensure's to judge.
        """
        if self.admission_wait_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission_wait_s
        polls = Backoff(first_s=ADMISSION_POLL_FIRST_S, cap_s=ADMISSION_POLL_CAP_S)
        where = f"{self._ns}/{base}"
        while True:
            dep = await self.read_deployment(base)
            if dep is None or (uid and str(getattr(dep.metadata, "uid", "") or "") != uid):
                return
            if pod_admitted(dep):
                return
            refused = pod_refusal(dep)
            if refused is not None:
                await self._delete("Deployment", base, uid)
                message = self._redact(refused, env)
                raise CapacityRefused(f"{self.driver_name} Deployment {where} was refused its pod: {message}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                self._logger.debug(
                    "Kubernetes sandbox admission not seen in time; going on",
                    extra={"deployment": base, "seconds": self.admission_wait_s},
                )
                return
            await asyncio.sleep(min(polls.failed(), remaining))

    async def _undo(self, secret_uid: str, claim_uid: str, base: str) -> None:
        """Delete the Secret and claim this ensure wrote (by uid: only those very objects)."""
        if secret_uid:
            await self._delete("Secret", secret_name(base), secret_uid)
        if claim_uid:
            await self._delete("PersistentVolumeClaim", pvc_name(base), claim_uid)

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        """Delete this sandbox's Deployment, Secret and claim; another sandbox's is left alone."""
        base = sandbox_base_name(scope, sandbox_id)
        dep = await self.read_deployment(base)
        found: list[Found] = [] if dep is None else [self._found_deployment(dep, base)]
        for kind, name in (("Secret", secret_name(base)), ("PersistentVolumeClaim", pvc_name(base))):
            if kind == "Secret" or scope in PERSISTENT_SCOPES:
                obj = await self.find(kind, name)
                if obj is not None:
                    found.append(obj)
        left = [f for f in found if not self.owns(f, scope, sandbox_id)]
        for f in found:
            if f in left:
                self.left_alone(f, scope, sandbox_id)
            else:
                await self._delete(f.kind, f.name, f.uid)
        self._logger.info(
            "Kubernetes sandbox deprovisioned",
            extra={
                "scope": scope,
                "id": sandbox_id,
                "deployment": base,
                "leftAlone": [f.describe(self._installation) for f in left],
            },
        )

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        """``absent`` also when the Deployment under the name is another sandbox's."""
        base = sandbox_base_name(scope, sandbox_id)
        dep = await self.read_deployment(base)
        if dep is None or not self.owns(self._found_deployment(dep, base), scope, sandbox_id):
            return "absent"
        return "running" if _replicas(dep) >= 1 else "stopped"

    async def list_managed(self) -> list[ManagedSandbox]:
        found: list[ManagedSandbox] = []
        token: str | None = None
        while True:
            page = await self._call(
                f"list Deployments in {self._ns}",
                self._apps.list_namespaced_deployment,
                self._ns,
                label_selector=self._selector,
                limit=self.list_page_size,
                _continue=token,
            )
            assert page is not None
            for dep in page.items or []:
                if dep.metadata is None:
                    continue
                labels: Mapping[str, str] = dep.metadata.labels or {}
                if labels.get(LABEL_INSTALLATION) != self._installation:
                    continue  # (the selector says so already: a second look costs nothing)
                scope = labels.get(LABEL_SCOPE)
                sandbox_id = labels.get(LABEL_SANDBOX_ID)
                if scope not in SCOPES or not sandbox_id:
                    continue
                replicas = int((dep.spec.replicas if dep.spec is not None else 0) or 0)
                state: SandboxProbeState = "running" if replicas >= 1 else "stopped"
                stamp = dep.metadata.creation_timestamp
                created_at = stamp.timestamp() if stamp is not None else None
                found.append(
                    ManagedSandbox(scope, sandbox_id, str(dep.metadata.name), state, created_at=created_at)
                )
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                break
        return sorted(found, key=lambda m: (m.scope, m.sandbox_id))

    async def close(self) -> None:
        await asyncio.to_thread(self._api_client.close)


# --------------------------------------------------------------------------- factory


def boot_checks(config: DriverConfig, driver: str = DRIVER_NAME) -> None:
    """Both in-cluster addresses are required: a pod cannot reach this process's localhost."""
    if not config.backend_endpoint:
        raise ValueError(backend_endpoint_required(driver))
    if not config.temporal_address:
        raise ValueError(temporal_address_required(driver))


def load_client_configuration(options: Mapping[str, str]) -> Any:
    """``options["kubeconfig"]`` if set, else in-cluster, else the default kubeconfig."""
    cfg = k8s.Configuration()
    kubeconfig = options.get("kubeconfig")
    context = options.get("kubeconfig_context") or None
    try:
        if kubeconfig:
            _load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
            return cfg
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            try:
                _load_incluster_config(client_configuration=cfg)
                return cfg
            except ConfigException:
                pass
        _load_kube_config(context=context, client_configuration=cfg)
        return cfg
    except (ConfigException, OSError, ValueError) as exc:
        raise ValueError(
            f"sandbox provisioner '{DRIVER_NAME}': no usable Kubernetes client config: {exc}"
        ) from None


DEFAULT_MAX_POOL_SIZE: Final = 32
#: How long an ensure waits for the engine to admit or refuse the sandbox's pod (seconds).
DEFAULT_ADMISSION_WAIT_S: Final = 10.0
#: The admission wait reads the Deployment again after 50 ms, backing off to every 500 ms.
ADMISSION_POLL_FIRST_S: Final = 0.05
ADMISSION_POLL_CAP_S: Final = 0.5


def admission_wait_seconds(options: Mapping[str, str]) -> float:
    """``options["admission_wait_seconds"]``: 0 turns the admission wait off (no refusal of a pod seen)."""
    raw = options.get("admission_wait_seconds") or str(DEFAULT_ADMISSION_WAIT_S)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"sandbox provisioner '{DRIVER_NAME}': admission_wait_seconds must be a number >= 0, got {raw!r}"
        )
    return value


def max_pool_size(options: Mapping[str, str]) -> int:
    raw = options.get("max_pool_size") or str(DEFAULT_MAX_POOL_SIZE)
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(
            f"sandbox provisioner '{DRIVER_NAME}': max_pool_size must be a whole number >= 1, got {raw!r}"
        )
    return size


def new_kubernetes_provisioner(config: DriverConfig, logger: logging.Logger) -> KubernetesProvisioner:
    boot_checks(config)
    pool = max_pool_size(config.options)
    cfg = load_client_configuration(config.options)
    cfg.connection_pool_maxsize = pool
    return KubernetesProvisioner(config, logger, k8s.ApiClient(cfg))
