"""Tier 1 of the isolation ladder: the runner as a local child process (upstream ``local-process.ts``).

Differences from upstream, all in the direction of "a restarted pod keeps
control of what it started":

* The child's identity (pid, its start time from ``/proc/<pid>/stat``, the boot
  id, scope, id, name) is persisted under the state dir, so a new provisioner
  instance finds, probes and tears down children an earlier instance started.
  The start time and boot id guard against a recycled pid.
* The child leads its own process group (``start_new_session``); deprovision
  signals the whole group with SIGTERM, waits up to a grace period, then
  SIGKILLs it, and only returns once nothing of the group is left running.
* Closing the provisioner leaves children running (a pod restart adopts them);
  they are ended by deprovision.
* A runner command that cannot be started fails the ensure with a
  :class:`SandboxError` instead of an asynchronous log line.
* Records are kept by sandbox name, and two ids can share a name (48 bits of sha256): a record
  names its sandbox's scope and id, and the driver checks them before it fast-paths onto or kills
  the recorded process group. Another sandbox's runner fails the ensure with
  :class:`SandboxCollision` (naming its process group, record and owner) and is never signalled;
  a deprovision leaves it alone and logs it; a probe reports ``absent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

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
from drivers.naming import sandbox_base_name
from drivers.runner.env import build_runner_env, inheritable_parent_env

DRIVER_NAME: Final = "local-process"
DEFAULT_STATE_DIR: Final = "~/.stigmer/sandboxes"
DEFAULT_GRACE_SECONDS: Final = 10.0
#: How long to wait for the group to vanish after SIGKILL before giving up.
KILL_WAIT_SECONDS: Final = 5.0
_POLL_SECONDS: Final = 0.05
_RECORD_DIR: Final = ".local-process"
LOG_LEFT_ALONE: Final = "Local-process sandbox deprovision left another sandbox's runner alone"
#: In each runner's environment: the installation that started it, so a runner found by its workspace
#: alone (never recorded) is adopted or ended only by its own installation (two installations may
#: share a state dir).
INSTALLATION_ENV: Final = "STIGMER_SANDBOX_INSTALLATION"


@dataclass(frozen=True)
class ProcessIdentity:
    """Enough to recognise one process across pod restarts and pid reuse."""

    pid: int
    start_time: int
    boot_id: str


@dataclass(frozen=True)
class ChildRecord:
    scope: SandboxScope
    sandbox_id: str
    name: str
    pid: int
    pgid: int
    start_time: int
    boot_id: str
    command: list[str]
    workspace: str
    started_at: float
    #: The installation that started it ("" in a record written before installations were recorded:
    #: no installation's, so left alone).
    installation: str = ""

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_time, self.boot_id)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start_time) of ``pid`` from ``/proc/<pid>/stat``, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[2]), int(rest[19])
    except (IndexError, ValueError):
        return None


def _is_live(stat: tuple[str, int, int] | None) -> bool:
    return stat is not None and stat[0] not in ("Z", "X", "x")


def identity_of(pid: int) -> ProcessIdentity | None:
    stat = _read_stat(pid)
    if stat is None:
        return None
    return ProcessIdentity(pid, stat[2], _boot_id())


def unrecorded_runner(workspace: Path, installation: str) -> ProcessIdentity | None:
    """A live runner of this workspace that no record names: a group leader whose environment has
    ``WORKSPACE_ROOT_DIR=<workspace>`` and this installation's ``STIGMER_SANDBOX_INSTALLATION``.
    Another pod (sharing the state dir) spawned it and stopped before recording it (a SIGSTOP, a
    crash between the two): it is adopted, not doubled."""
    needle = f"WORKSPACE_ROOT_DIR={workspace}".encode()
    mark = f"{INSTALLATION_ENV}={installation}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle not in environ or mark not in environ:
            continue
        pid = int(entry.name)
        stat = _read_stat(pid)
        if _is_live(stat) and stat is not None and stat[1] == pid:
            return ProcessIdentity(pid, stat[2], _boot_id())
    return None


def is_same_live_process(identity: ProcessIdentity) -> bool:
    """True if ``identity.pid`` is still that very process and has not exited."""
    if identity.boot_id and identity.boot_id != _boot_id():
        return False
    stat = _read_stat(identity.pid)
    return _is_live(stat) and stat is not None and stat[2] == identity.start_time


def live_group_members(pgid: int) -> list[int]:
    """Pids of non-zombie processes whose process group is ``pgid``."""
    members: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _read_stat(int(entry.name))
        if stat is not None and stat[1] == pgid and _is_live(stat):
            members.append(int(entry.name))
    return members


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _parse_grace(options: Mapping[str, str]) -> float:
    raw = options.get("grace_seconds", "")
    if raw == "":
        return DEFAULT_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(
            f"sandbox provisioner 'local-process': grace_seconds must be a number, got {raw!r}"
        ) from exc
    if value < 0:
        raise ValueError("sandbox provisioner 'local-process': grace_seconds must not be negative")
    return value


def _owns(record: ChildRecord, scope: SandboxScope, sandbox_id: str, installation: str) -> bool:
    """Is the record this sandbox's (its id, scope and installation), not another id's that shares the
    name, nor another installation's sharing the state dir?"""
    return record.sandbox_id == sandbox_id and record.scope == scope and record.installation == installation


def _workspace_segment(scope: SandboxScope, sandbox_id: str) -> str:
    # Upstream uses the raw id in the directory name; refuse ids that would
    # escape the sandboxes directory instead of silently rewriting them.
    segment = f"{scope}-{sandbox_id}"
    if not sandbox_id or "/" in sandbox_id or "\0" in sandbox_id or sandbox_id in (".", ".."):
        raise SandboxError(f"local-process sandbox id {sandbox_id!r} is not usable as a directory name")
    return segment


class LocalProcessProvisioner(ScopedMethods):
    """Runner children of this pod, tracked in memory and on disk."""

    def __init__(self, config: DriverConfig, logger: logging.Logger) -> None:
        self._config = config
        self._logger = logger
        try:
            self._command = shlex.split(config.runner_command)
        except ValueError as exc:
            raise ValueError(
                f"sandbox provisioner 'local-process': runner command does not parse: {exc}"
            ) from exc
        if not self._command:
            raise ValueError("sandbox provisioner 'local-process' requires a runner command")
        self._state_dir = Path(os.path.expanduser(config.options.get("state_dir", "") or DEFAULT_STATE_DIR))
        self._record_dir = self._state_dir / _RECORD_DIR
        self._grace = _parse_grace(config.options)
        self._installation = config.installation
        #: One lock per sandbox name while an ensure or a deprovision uses it.
        self._locks = KeyedLocks()
        self._children: dict[str, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def driver_name(self) -> str:
        return DRIVER_NAME

    @property
    def state_dir(self) -> Path:
        return self._state_dir

    def workspace_dir(self, scope: SandboxScope, sandbox_id: str) -> Path:
        return self._state_dir / _workspace_segment(scope, sandbox_id)

    # -- state on disk -------------------------------------------------------

    def _record_path(self, name: str) -> Path:
        return self._record_dir / f"{name}.json"

    def _write_record(self, record: ChildRecord) -> None:
        self._record_dir.mkdir(parents=True, exist_ok=True)
        path = self._record_path(record.name)
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(record), sort_keys=True))
        os.replace(tmp, path)

    def _read_record(self, name: str) -> ChildRecord | None:
        return self._load_record(self._record_path(name))

    def _load_record(self, path: Path) -> ChildRecord | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._logger.warning(
                "Local-process sandbox state unreadable, ignoring",
                extra={"path": str(path), "error": str(exc)},
            )
            return None
        try:
            if data["scope"] not in SCOPES:
                raise ValueError(f"unknown scope {data['scope']!r}")
            return ChildRecord(
                scope=data["scope"],
                sandbox_id=str(data["sandbox_id"]),
                name=str(data["name"]),
                pid=int(data["pid"]),
                pgid=int(data["pgid"]),
                start_time=int(data["start_time"]),
                boot_id=str(data["boot_id"]),
                command=[str(c) for c in data["command"]],
                workspace=str(data["workspace"]),
                started_at=float(data["started_at"]),
                installation=str(data.get("installation", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            self._logger.warning(
                "Local-process sandbox state unreadable, ignoring",
                extra={"path": str(path), "error": str(exc)},
            )
            return None

    def _remove_record(self, name: str, only_if: ProcessIdentity | None = None) -> None:
        """Remove the record; with ``only_if``, only while it still names that process."""
        if only_if is not None:
            current = self._read_record(name)
            if current is None or current.identity != only_if:
                return
        with contextlib.suppress(FileNotFoundError):
            self._record_path(name).unlink()

    def _live_record(self, name: str) -> ChildRecord | None:
        """The record if its process is still that live process; a stale record is dropped."""
        record = self._read_record(name)
        if record is None:
            return None
        if is_same_live_process(record.identity):
            return record
        self._remove_record(name, only_if=record.identity)
        return None

    def _collision(self, record: ChildRecord, scope: SandboxScope, sandbox_id: str) -> SandboxCollision:
        return SandboxCollision(
            DRIVER_NAME,
            "runner process group",
            f"{record.pgid} (record {self._record_path(record.name)})",
            record.name,
            scope,
            sandbox_id,
            record.sandbox_id,
            record.scope,
            record.installation,
            self._installation,
        )

    def _lock(self, name: str) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks.hold(name)

    def _ours(self, record: ChildRecord, scope: SandboxScope, sandbox_id: str) -> bool:
        return _owns(record, scope, sandbox_id, self._installation)

    # -- contract ------------------------------------------------------------

    async def ensure(
        self, scope: SandboxScope, sandbox_id: str, env: SandboxEnvironment
    ) -> SandboxProbeState:
        name = sandbox_base_name(scope, sandbox_id)
        workspace = self.workspace_dir(scope, sandbox_id)
        async with self._lock(name):
            live = self._live_record(name)
            if live is not None:
                if not self._ours(live, scope, sandbox_id):  # another sandbox's runner: never adopted
                    raise self._collision(live, scope, sandbox_id)
                return "running"
            found = await asyncio.to_thread(unrecorded_runner, workspace, self._installation)
            if found is not None:
                self._adopt(scope, sandbox_id, name, workspace, found)
                return "running"
            try:
                workspace.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SandboxError(f"local-process workspace {str(workspace)!r} unusable: {exc}") from exc
            contract = build_runner_env(self._config, env, workspace_dir=str(workspace))
            child_env = {
                **inheritable_parent_env(os.environ, self._config.withheld_env),
                **contract.merged(),
                INSTALLATION_ENV: self._installation,
            }
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._command,
                    stdin=asyncio.subprocess.DEVNULL,
                    env=child_env,
                    start_new_session=True,
                )
            except OSError as exc:
                self._logger.error(
                    "Local-process sandbox failed to start",
                    extra={
                        "scope": scope,
                        "id": sandbox_id,
                        "command": self._command[0],
                        "error": str(exc),
                    },
                )
                raise SandboxError(
                    f"local-process runner command {self._command[0]!r} failed to start: "
                    f"{exc.strerror or exc}"
                ) from exc
            identity = identity_of(proc.pid)
            other = self._live_record(name)
            if other is not None and identity is not None and other.identity != identity:
                # Another pod recorded a runner for this name while this one was spawning (this
                # process was stopped in between): keep theirs, end ours.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                if not self._ours(other, scope, sandbox_id):
                    raise self._collision(other, scope, sandbox_id)
                return "running"
            if identity is not None:
                record = self._new_record(scope, sandbox_id, name, workspace, identity)
                try:
                    self._write_record(record)
                except OSError as exc:
                    # An untracked child would outlive every later deprovision: end it now.
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
                    raise SandboxError(f"local-process state dir unusable: {exc}") from exc
            self._children[name] = proc
            watcher = asyncio.create_task(self._watch(scope, sandbox_id, name, proc, identity))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
            self._logger.info(
                "Local-process sandbox started",
                extra={
                    "scope": scope,
                    "id": sandbox_id,
                    "pid": proc.pid,
                    "taskQueue": env.task_queue,
                },
            )
            return "running"

    def _new_record(
        self, scope: SandboxScope, sandbox_id: str, name: str, workspace: Path, identity: ProcessIdentity
    ) -> ChildRecord:
        """The record of a runner (its own process group leader)."""
        return ChildRecord(
            scope=scope,
            sandbox_id=sandbox_id,
            name=name,
            pid=identity.pid,
            pgid=identity.pid,
            start_time=identity.start_time,
            boot_id=identity.boot_id,
            command=list(self._command),
            workspace=str(workspace),
            started_at=time.time(),
            installation=self._installation,
        )

    def _adopt(
        self, scope: SandboxScope, sandbox_id: str, name: str, workspace: Path, identity: ProcessIdentity
    ) -> ChildRecord:
        record = self._new_record(scope, sandbox_id, name, workspace, identity)
        self._write_record(record)
        self._logger.info(
            "Local-process sandbox adopted (running, unrecorded)",
            extra={"scope": scope, "id": sandbox_id, "pid": identity.pid},
        )
        return record

    async def _watch(
        self,
        scope: SandboxScope,
        sandbox_id: str,
        name: str,
        proc: asyncio.subprocess.Process,
        identity: ProcessIdentity | None,
    ) -> None:
        code = await proc.wait()
        # Only forget *this* child: a late exit never clobbers a replacement.
        if self._children.get(name) is proc:
            del self._children[name]
        if identity is not None:
            self._remove_record(name, only_if=identity)
        self._logger.info(
            "Local-process sandbox exited",
            extra={
                "scope": scope,
                "id": sandbox_id,
                "code": code if code >= 0 else None,
                "signal": _signal_name(-code) if code < 0 else None,
            },
        )

    async def deprovision(self, scope: SandboxScope, sandbox_id: str) -> None:
        name = sandbox_base_name(scope, sandbox_id)
        async with self._lock(name):
            record = self._read_record(name)
            theirs = record is not None and not self._ours(record, scope, sandbox_id)
            if record is not None and theirs:
                self._logger.warning(
                    LOG_LEFT_ALONE,
                    extra={
                        "scope": scope,
                        "id": sandbox_id,
                        "ownerId": record.sandbox_id,
                        "ownerInstallation": record.installation,
                        "pid": record.pid,
                        "leftAlone": f"runner process group {record.pgid} of {record.scope} "
                        f"'{record.sandbox_id}' (record {self._record_path(name)})",
                    },
                )
                record = None
            if record is None:
                # Spawned by a pod that stopped before recording it: still this sandbox's runner
                # (found by its own workspace, which no other id shares).
                workspace = self.workspace_dir(scope, sandbox_id)
                found = await asyncio.to_thread(unrecorded_runner, workspace, self._installation)
                if found is None:
                    return
                if theirs:  # the name's record is another's: end ours without recording it
                    record = self._new_record(scope, sandbox_id, name, workspace, found)
                    await self._terminate(record)
                    return
                record = self._adopt(scope, sandbox_id, name, workspace, found)
            await self._terminate(record)
            proc = self._children.pop(name, None)
            if proc is not None:
                # Our own child: make sure it is reaped before we report success.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_WAIT_SECONDS)
            self._remove_record(name)
            self._logger.info(
                "Local-process sandbox deprovisioned",
                extra={"scope": scope, "id": sandbox_id, "pid": record.pid},
            )

    @staticmethod
    def _group_is_ours_and_alive(record: ChildRecord) -> bool:
        """Is anything of the recorded process group still running?

        While any member of a group lives, its pgid cannot be reused as a pid, so
        members under the recorded pgid are ours unless the leader's pid slot now
        holds a different process (the group emptied and the pid was recycled).
        """
        if record.boot_id and record.boot_id != _boot_id():
            return False
        stat = _read_stat(record.pid)
        if stat is not None and stat[2] != record.start_time:
            return False
        if _is_live(stat):
            return True
        return bool(live_group_members(record.pgid))

    def _signal_group(self, record: ChildRecord, sig: signal.Signals) -> None:
        if not self._group_is_ours_and_alive(record):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pgid, sig)

    async def _terminate(self, record: ChildRecord) -> None:
        if not self._group_is_ours_and_alive(record):
            return
        self._signal_group(record, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace
        while self._group_is_ours_and_alive(record) and loop.time() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
        if not self._group_is_ours_and_alive(record):
            return
        self._logger.warning(
            "Local-process sandbox ignored SIGTERM, killing",
            extra={
                "scope": record.scope,
                "id": record.sandbox_id,
                "pid": record.pid,
                "grace_seconds": self._grace,
            },
        )
        self._signal_group(record, signal.SIGKILL)
        deadline = loop.time() + KILL_WAIT_SECONDS
        while self._group_is_ours_and_alive(record) and loop.time() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
        if self._group_is_ours_and_alive(record):
            raise SandboxError(
                f"local-process sandbox {record.scope} '{record.sandbox_id}' (pid {record.pid}) "
                "survived SIGKILL"
            )

    async def probe(self, scope: SandboxScope, sandbox_id: str) -> SandboxProbeState:
        name = sandbox_base_name(scope, sandbox_id)
        live = self._live_record(name)
        return "running" if live is not None and self._ours(live, scope, sandbox_id) else "absent"

    async def list_managed(self) -> list[ManagedSandbox]:
        found: list[ManagedSandbox] = []
        if not self._record_dir.is_dir():
            return found
        for path in sorted(self._record_dir.glob("*.json")):
            record = self._load_record(path)
            if record is None:
                continue
            if record.installation != self._installation:
                continue  # another installation's runner (or an unrecorded installation's): not ours to list
            if is_same_live_process(record.identity):
                found.append(
                    ManagedSandbox(
                        record.scope, record.sandbox_id, record.name, "running", created_at=record.started_at
                    )
                )
            else:
                self._remove_record(record.name, only_if=record.identity)
        return found

    async def close(self) -> None:
        """Stop watching; the children keep running for the next instance to adopt."""
        for task in list(self._watchers):
            task.cancel()
        for task in list(self._watchers):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._children.clear()


def new_local_process_provisioner(config: DriverConfig, logger: logging.Logger) -> LocalProcessProvisioner:
    return LocalProcessProvisioner(config, logger)
