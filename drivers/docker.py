"""Tier 2 of the isolation ladder: one Docker container per sandbox (upstream ``docker.ts``).

Upstream drives the docker CLI; this port uses the Docker SDK for Python over the
engine API, so secrets travel in the create request body and never in any
process's argv. The container shape follows spec 5.2 (name, the three labels,
``--user 0:0``, ``--workdir /workspace``, the env contract, the
``/runner/bin/start /runner/dist/main.js`` launch) plus safe defaults upstream
does not set: memory/CPU/pid limits, ``no-new-privileges``, every capability
dropped, network ``none`` unless configured, optional read-only root.

The SDK is blocking; every engine call runs in a worker thread.

Ownership: names are 48 bits of sha256, so two ids can share one, and two installations can share an
engine. Every call checks the container's labels first (``sandbox-id``, ``scope`` and
``installation``), and acts on the container by its id; another sandbox's container (another id's or
installation's) fails the ensure with
:class:`~drivers.contract.SandboxCollision` (naming the container and its owner's id), is left alone
by a deprovision (logged, ``LOG_LEFT_ALONE``) and probes ``absent``; a container carrying none of
our labels is refused with a ``SandboxError``.

Options (``DriverConfig.options``): ``docker_host``, ``api_version`` (default
``auto``), ``timeout`` (seconds, default 60), ``image`` (default
``runner_image``), ``entrypoint`` / ``command`` (shell-split, ``""`` = the
image's own), ``memory`` (default ``2g``), ``cpus`` (default ``2``),
``pids_limit`` (default 4096, ``0`` = unlimited), ``network`` (default
``none``), ``read_only`` (``true``/``false``, default false).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import docker
import docker.errors
from docker.types import Mount

from drivers.contract import (
    SCOPES,
    DriverConfig,
    ManagedSandbox,
    SandboxCollision,
    SandboxEnvironment,
    SandboxError,
    SandboxProbeState,
    SandboxScope,
    ScopedMethods,
)
from drivers.locks import KeyedLocks
from drivers.naming import (
    LABEL_INSTALLATION,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_SCOPE,
    MANAGED_BY_VALUE,
    is_owned_by,
    label_owner,
    sandbox_base_name,
    sandbox_labels,
)
from drivers.runner.env import build_runner_env, scrub
from drivers.runner.launch import RUNNER_GID, RUNNER_HOME, RUNNER_MAIN, RUNNER_START, RUNNER_UID

DRIVER_NAME: Final = "docker"
DEFAULT_DOCKER_HOST: Final = "unix:///var/run/docker.sock"
RUNNER_ENTRYPOINT: Final = RUNNER_START
RUNNER_COMMAND: Final = RUNNER_MAIN
CONTAINER_USER: Final = f"{RUNNER_UID}:{RUNNER_GID}"
CONTAINER_WORKDIR: Final = "/workspace"
CONTAINER_HOME: Final = RUNNER_HOME

BACKEND_ENDPOINT_REQUIRED: Final = (
    "sandbox provisioner 'docker' requires STIGMER_SANDBOX_BACKEND_ENDPOINT"
    " — a container cannot reach the server on this process's localhost"
)
TEMPORAL_ADDRESS_REQUIRED: Final = (
    "sandbox provisioner 'docker' requires STIGMER_SANDBOX_TEMPORAL_ADDRESS (or TEMPORAL_HOST_PORT)"
    " reachable from inside a container"
)

LOG_LEFT_ALONE: Final = "Docker sandbox deprovision left another sandbox's container alone"

_CONFLICT_ATTEMPTS: Final = 3
_CONFLICT_WAIT_SECONDS: Final = 5.0

_T = TypeVar("_T")
_UNITS: Final[dict[str, int]] = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_memory(raw: str) -> int:
    """``2g`` / ``512m`` / ``1073741824`` → bytes (docker's binary units)."""
    text = raw.strip().lower()
    if text.endswith("ib"):
        text = text[:-2]
    elif len(text) > 1 and text.endswith("b") and text[-2] in _UNITS:
        text = text[:-1]
    unit = text[-1] if text and text[-1] in _UNITS and not text[-1].isdigit() else ""
    number = text[: len(text) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError as exc:
        raise ValueError(
            f"sandbox provisioner 'docker': memory {raw!r} is not a size like 2g or 512m"
        ) from exc
    if value < 6 * 1024**2:
        raise ValueError(f"sandbox provisioner 'docker': memory {raw!r} is below docker's 6m minimum")
    return int(value)


def _parse_bool(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"sandbox provisioner 'docker': {name} must be true or false, got {raw!r}")


def _parse_number(name: str, raw: str, *, minimum: float) -> float:
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"sandbox provisioner 'docker': {name} must be a number, got {raw!r}") from exc
    if value < minimum:
        raise ValueError(f"sandbox provisioner 'docker': {name} must be at least {minimum}, got {raw!r}")
    return value


def _split(name: str, raw: str) -> list[str] | None:
    if raw.strip() == "":
        return None
    try:
        return shlex.split(raw)
    except ValueError as exc:
        raise ValueError(f"sandbox provisioner 'docker': {name} does not parse: {exc}") from exc


@dataclass(frozen=True)
class DockerSettings:
    """Everything the options say, validated once at boot."""

    base_url: str
    api_version: str
    timeout: int
    image: str
    entrypoint: list[str] | None
    command: list[str] | None
    #: Limits: 0 = none (upstream sets none).
    memory_bytes: int
    nano_cpus: int
    pids_limit: int
    #: "" = the engine's default network (upstream's: the runner reaches the backend and Temporal).
    network: str
    #: All capabilities dropped and no-new-privileges (upstream changes neither).
    hardened: bool
    read_only: bool
    max_pool_size: int

    @classmethod
    def from_config(cls, config: DriverConfig) -> DockerSettings:
        o: Mapping[str, str] = config.options
        entrypoint = _split("entrypoint", o["entrypoint"]) if "entrypoint" in o else [RUNNER_ENTRYPOINT]
        command = _split("command", o["command"]) if "command" in o else [RUNNER_COMMAND]
        cpus = _parse_number("cpus", o["cpus"], minimum=0.01) if o.get("cpus", "") else 0.0
        return cls(
            base_url=o.get("docker_host", "") or os.environ.get("DOCKER_HOST", "") or DEFAULT_DOCKER_HOST,
            api_version=o.get("api_version", "") or "auto",
            timeout=int(_parse_number("timeout", o.get("timeout", "") or "60", minimum=1)),
            image=o.get("image", "") or config.runner_image,
            entrypoint=entrypoint,
            command=command,
            memory_bytes=parse_memory(o["memory"]) if o.get("memory", "") else 0,
            nano_cpus=int(cpus * 1e9),
            pids_limit=int(_parse_number("pids_limit", o.get("pids_limit", "") or "0", minimum=0)),
            network=o.get("network", ""),
            hardened=_parse_bool("hardened", o.get("hardened", "")),
            read_only=_parse_bool("read_only", o.get("read_only", "")),
            # The pod runs up to SANDBOX_LANES_DRIVER_CONCURRENCY calls at once (default 32); the
            # SDK's default pool of 10 connections would open and discard the rest each time.
            max_pool_size=int(_parse_number("max_pool_size", o.get("max_pool_size", "") or "32", minimum=1)),
        )


def _is_ours(attrs: Mapping[str, Any], scope: SandboxScope, sandbox_id: str, installation: str) -> bool:
    return is_owned_by(_labels(attrs), scope, sandbox_id, installation)


def _labels(attrs: Mapping[str, Any]) -> Mapping[str, str]:
    labels: Mapping[str, str] = (attrs.get("Config") or {}).get("Labels") or {}
    return labels


def _other_sandbox(attrs: Mapping[str, Any], scope: SandboxScope, sandbox_id: str, installation: str) -> bool:
    """Another managed sandbox's container (another id sharing this one's name, or another
    installation's sandbox on the same engine): a name collision."""
    owner = label_owner(_labels(attrs))
    return owner is not None and not _is_ours(attrs, scope, sandbox_id, installation)


def _state_of(attrs: Mapping[str, Any]) -> SandboxProbeState:
    state: Mapping[str, Any] = attrs.get("State") or {}
    return "running" if state.get("Running") and not state.get("Paused") else "stopped"


class DockerProvisioner(ScopedMethods):
    """Containers named ``sbx-<code>-<hash>`` carrying the three stigmer labels."""

    def __init__(self, config: DriverConfig, logger: logging.Logger) -> None:
        if not config.backend_endpoint:
            raise ValueError(BACKEND_ENDPOINT_REQUIRED)
        if not config.temporal_address:
            raise ValueError(TEMPORAL_ADDRESS_REQUIRED)
        self._config = config
        self._logger = logger
        self._settings = DockerSettings.from_config(config)
        self._client: Any = None
        self._client_lock = asyncio.Lock()
        self._installation = config.installation
        #: One lock per container name while an ensure or a deprovision uses it.
        self._locks = KeyedLocks()

    @property
    def driver_name(self) -> str:
        return DRIVER_NAME

    @property
    def settings(self) -> DockerSettings:
        return self._settings

    # -- engine plumbing -----------------------------------------------------

    def _engine_error(self, exc: BaseException, secrets: list[str] | None = None) -> SandboxError:
        text = scrub(str(exc) or type(exc).__name__, secrets or [])
        return SandboxError(f"docker engine error ({self._settings.base_url}): {text}")

    async def _docker(self) -> Any:
        """The SDK client, created on first use (API version negotiation needs the engine)."""
        async with self._client_lock:
            if self._client is None:
                s = self._settings

                def connect() -> Any:
                    return docker.DockerClient(
                        base_url=s.base_url,
                        version=s.api_version,
                        timeout=s.timeout,
                        max_pool_size=s.max_pool_size,
                    )

                try:
                    self._client = await asyncio.to_thread(connect)
                except (docker.errors.DockerException, OSError) as exc:
                    raise self._engine_error(exc) from exc
            return self._client

    async def _call(self, fn: Callable[[], _T], secrets: list[str] | None = None) -> _T:
        """Run a blocking SDK call in a thread; transport failures become SandboxError.

        ``docker.errors.APIError`` (an HTTP answer from the engine) is re-raised
        as is so callers can branch on 404/409.
        """
        try:
            return await asyncio.to_thread(fn)
        except docker.errors.APIError:
            raise
        except (docker.errors.DockerException, OSError) as exc:
            # requests' exceptions derive from OSError (IOError).
            raise self._engine_error(exc, secrets) from exc

    async def _inspect(self, name: str) -> dict[str, Any] | None:
        client = await self._docker()
        try:
            attrs: dict[str, Any] = await self._call(lambda: client.api.inspect_container(name))
        except docker.errors.NotFound:
            return None
        except docker.errors.APIError as exc:
            raise self._engine_error(exc) from exc
        return attrs

    def _lock(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks.hold(name)

    def _ours(self, attrs: Mapping[str, Any], scope: SandboxScope, sandbox_id: str) -> bool:
        return _is_ours(attrs, scope, sandbox_id, self._installation)

    def _others(self, attrs: Mapping[str, Any], scope: SandboxScope, sandbox_id: str) -> bool:
        return _other_sandbox(attrs, scope, sandbox_id, self._installation)

    def _not_ours(
        self, attrs: Mapping[str, Any], name: str, scope: SandboxScope, sandbox_id: str
    ) -> SandboxError:
        """Another sandbox's container is a :class:`SandboxCollision` naming it and its owner;
        a container of no sandbox of ours keeps the ``refusing`` error."""
        if self._others(attrs, scope, sandbox_id):
            labels = _labels(attrs)
            return SandboxCollision(
                DRIVER_NAME,
                "container",
                f"{name} ({str(attrs.get('Id', ''))[:12]})",
                name,
                scope,
                sandbox_id,
                label_owner(labels),
                labels.get(LABEL_SCOPE),
                labels.get(LABEL_INSTALLATION),
                self._installation,
            )
        return self._foreign(name, scope, sandbox_id)

    def _foreign(self, name: str, scope: SandboxScope, sandbox_id: str) -> SandboxError:
        """Not this sandbox's container: another sandbox's (a name collision) or none of ours."""
        return SandboxError(
            f"docker container name '{name}' is taken by a container that is not the managed sandbox "
            f"for {scope} '{sandbox_id}' (labels {LABEL_MANAGED_BY}={MANAGED_BY_VALUE}, "
            f"{LABEL_INSTALLATION}={self._installation}, {LABEL_SANDBOX_ID}={sandbox_id} missing or "
            "different); refusing to use or remove it"
        )

    # -- contract ------------------------------------------------------------

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        name = sandbox_base_name(scope, sandbox_id)
        async with self._lock(name):
            attrs = await self._inspect(name)
            if attrs is None:
                attrs = await self._create(scope, sandbox_id, name, env)
                if attrs is None:
                    return "running"
            if not self._ours(attrs, scope, sandbox_id):
                raise self._not_ours(attrs, name, scope, sandbox_id)
            if _state_of(attrs) == "running":
                return "running"
            await self._start(attrs, scope, sandbox_id)
            self._logger.info(
                "Docker sandbox restarted",
                extra={"scope": scope, "id": sandbox_id, "container": name},
            )
            return "running"

    async def _create(
        self, scope: SandboxScope, sandbox_id: str, name: str, env: SandboxEnvironment
    ) -> dict[str, Any] | None:
        """Create and start (``docker run --detach``); on a name conflict return the holder's attrs.

        The low-level API, as the CLI does: the SDK's ``containers.create`` inspects every new
        container once more, a third engine round trip per ensure that nothing here reads.
        """
        s = self._settings
        contract = build_runner_env(self._config, env, workspace_dir=CONTAINER_WORKDIR, home=CONTAINER_HOME)
        secrets = contract.secret_values()
        client = await self._docker()
        # Upstream's `docker run` sets no network, limit or capability; each is an option here.
        host: dict[str, Any] = {"read_only": s.read_only}
        if s.memory_bytes:
            host["mem_limit"] = s.memory_bytes
            host["memswap_limit"] = s.memory_bytes
        if s.nano_cpus:
            host["nano_cpus"] = s.nano_cpus
        if s.pids_limit:
            host["pids_limit"] = s.pids_limit
        if s.network:
            host["network_mode"] = s.network
        if s.hardened:
            host["security_opt"] = ["no-new-privileges"]
            host["cap_drop"] = ["ALL"]
        if s.read_only:
            # The root is read-only; the workspace (an anonymous volume: survives
            # stop/start, removed with the container) and /tmp stay writable.
            host["mounts"] = [Mount(target=CONTAINER_WORKDIR, source=None, type="volume")]
            host["tmpfs"] = {"/tmp": "rw,nosuid,nodev"}
        kwargs: dict[str, Any] = {
            "name": name,
            "labels": sandbox_labels(scope, sandbox_id, self._config.installation),
            "user": CONTAINER_USER,
            "working_dir": CONTAINER_WORKDIR,
            "environment": contract.merged(),
            "detach": True,
            "host_config": client.api.create_host_config(**host),
        }
        if s.entrypoint is not None:
            kwargs["entrypoint"] = s.entrypoint
        if s.command is not None:
            kwargs["command"] = s.command
        container_id = ""
        pulled = False
        for _attempt in range(_CONFLICT_ATTEMPTS):
            try:
                created = await self._call(lambda: client.api.create_container(s.image, **kwargs), secrets)
                container_id = str(created["Id"])
                break
            except docker.errors.ImageNotFound as exc:
                if pulled:
                    raise self._engine_error(exc, secrets) from exc
                await self._pull(s.image)  # as `docker run` does; a local-only image never gets here
                pulled = True
                continue
            except docker.errors.APIError as exc:
                if exc.status_code != 409:
                    raise self._engine_error(exc, secrets) from exc
            # Name conflict: an earlier failed create, or another pod's ensure. The engine
            # reserves the name before the container is inspectable, so look for a moment.
            existing = await self._await_existing(name)
            if existing is None:
                continue  # the holder vanished (e.g. removed); try the create again
            if not self._ours(existing, scope, sandbox_id):
                raise self._not_ours(existing, name, scope, sandbox_id)
            self._logger.info(
                "Docker sandbox adopted",
                extra={
                    "scope": scope,
                    "id": sandbox_id,
                    "container": name,
                    "state": _state_of(existing),
                },
            )
            return existing
        if not container_id:
            raise SandboxError(f"docker container name '{name}' stayed in conflict without a container")
        try:
            await self._call(lambda: client.api.start(container_id), secrets)
        except docker.errors.APIError as exc:
            # The created container stays; the next ensure sees it stopped and retries the start.
            raise self._engine_error(exc, secrets) from exc
        self._logger.info(
            "Docker sandbox provisioned",
            extra={
                "scope": scope,
                "id": sandbox_id,
                "container": name,
                "taskQueue": env.task_queue,
                "image": s.image,
            },
        )
        return None

    async def _pull(self, image: str) -> None:
        client = await self._docker()
        try:
            await self._call(lambda: client.images.pull(image))
        except docker.errors.APIError as exc:
            raise self._engine_error(exc) from exc
        self._logger.info("Docker sandbox image pulled", extra={"image": image})

    async def _await_existing(self, name: str) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CONFLICT_WAIT_SECONDS
        while True:
            attrs = await self._inspect(name)
            if attrs is not None or loop.time() >= deadline:
                return attrs
            await asyncio.sleep(0.05)

    async def _start(self, attrs: Mapping[str, Any], scope: SandboxScope, sandbox_id: str) -> None:
        """Start (or unpause) the container checked, by its id: a same-named replacement is not it.
        Docker has no conditional start, so the id is the guard (the engine never reuses one)."""
        client = await self._docker()
        container_id = str(attrs["Id"])
        paused = bool((attrs.get("State") or {}).get("Paused"))
        try:
            if paused:
                await self._call(lambda: client.api.unpause(container_id))
            else:
                await self._call(lambda: client.api.start(container_id))
        except docker.errors.APIError as exc:
            raise self._engine_error(exc) from exc

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        name = sandbox_base_name(scope, sandbox_id)
        async with self._lock(name):
            attrs = await self._inspect(name)
            if attrs is None:
                return
            if self._others(attrs, scope, sandbox_id):
                # Another sandbox's container under the shared name: nothing of this one's to remove.
                labels = _labels(attrs)
                self._logger.warning(
                    LOG_LEFT_ALONE,
                    extra={
                        "scope": scope,
                        "id": sandbox_id,
                        "container": name,
                        "ownerId": label_owner(labels),
                        "ownerInstallation": labels.get(LABEL_INSTALLATION),
                        "leftAlone": f"container {name} of {labels.get(LABEL_SCOPE, scope)} "
                        f"'{label_owner(labels)}'"
                        + (
                            ""
                            if labels.get(LABEL_INSTALLATION) == self._installation
                            else f" of installation '{labels.get(LABEL_INSTALLATION) or ''}'"
                        ),
                    },
                )
                return
            if not self._ours(attrs, scope, sandbox_id):
                raise self._foreign(name, scope, sandbox_id)
            client = await self._docker()
            container_id = str(attrs["Id"])
            try:
                # By id, so a same-named replacement created meanwhile is never touched.
                await self._call(lambda: client.api.remove_container(container_id, force=True, v=True))
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:
                if exc.status_code != 409 or "already in progress" not in str(exc):
                    raise self._engine_error(exc) from exc
            self._logger.info(
                "Docker sandbox deprovisioned",
                extra={"scope": scope, "id": sandbox_id, "container": name},
            )

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        name = sandbox_base_name(scope, sandbox_id)
        attrs = await self._inspect(name)
        if attrs is None or self._others(attrs, scope, sandbox_id):
            return "absent"  # (another sandbox's container holds nothing of this one's)
        if not self._ours(attrs, scope, sandbox_id):
            raise self._foreign(name, scope, sandbox_id)
        return _state_of(attrs)

    async def list_managed(self) -> list[ManagedSandbox]:
        client = await self._docker()
        # This installation's containers only (both labels must match: the engine ANDs them).
        filters = {
            "label": [f"{LABEL_MANAGED_BY}={MANAGED_BY_VALUE}", f"{LABEL_INSTALLATION}={self._installation}"]
        }
        try:
            rows: list[dict[str, Any]] = await self._call(
                lambda: client.api.containers(all=True, filters=filters)
            )
        except docker.errors.APIError as exc:
            raise self._engine_error(exc) from exc
        found: list[ManagedSandbox] = []
        for row in rows:
            labels: Mapping[str, str] = row.get("Labels") or {}
            scope = next((sc for sc in SCOPES if sc == labels.get(LABEL_SCOPE)), None)
            sandbox_id = labels.get(LABEL_SANDBOX_ID, "")
            if scope is None or not sandbox_id or labels.get(LABEL_INSTALLATION) != self._installation:
                continue
            names: list[str] = row.get("Names") or []
            name = names[0].lstrip("/") if names else str(row.get("Id", ""))
            state: SandboxProbeState = "running" if row.get("State") == "running" else "stopped"
            created = row.get("Created")
            created_at = float(created) if isinstance(created, int | float) else None
            found.append(ManagedSandbox(scope, sandbox_id, name, state, created_at=created_at))
        return sorted(found, key=lambda m: (m.scope, m.sandbox_id))

    async def close(self) -> None:
        async with self._client_lock:
            if self._client is not None:
                client, self._client = self._client, None
                await asyncio.to_thread(client.close)


def new_docker_provisioner(config: DriverConfig, logger: logging.Logger) -> DockerProvisioner:
    return DockerProvisioner(config, logger)
