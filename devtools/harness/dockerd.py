"""A private Docker engine for the tests: Debian's dockerd on its own socket and data root.

Standard library only. The engine runs as root with the vfs storage driver, no
iptables and no default bridge, so it needs nothing from the host beyond the
``dockerd``/``containerd``/``runc`` binaries (Debian ``docker.io``). dockerd
starts its own containerd (under ``<root>/exec/containerd``) when ``containerd``
is on PATH. No registry is reachable, so the test image is made locally by
importing a rootfs tarball holding busybox-static and a stand-in for the
runner's ``/runner/bin/start`` + ``/runner/dist/main.js`` launch.

CLI::

    python -m harness.dockerd start [--root DIR]         # prints DOCKER_HOST=unix://DIR/docker.sock
    python -m harness.dockerd build-image [--root DIR] [--tag TAG]
    python -m harness.dockerd stop [--root DIR] [--purge]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Final
from urllib.parse import quote

DEFAULT_TAG: Final = "sandbox-lanes/busybox:test"
DEFAULT_BUSYBOX: Final = "/bin/busybox"
DEFAULT_CLI_ROOT: Final = os.path.join(tempfile.gettempdir(), "sandbox-lanes-dockerd")
START_TIMEOUT: Final = 60.0
STOP_TIMEOUT: Final = 30.0

#: The runner launch stand-in: ``start`` execs its arguments, as the real one execs node.
RUNNER_START_SCRIPT: Final = """#!/bin/sh
# sandbox-lanes test stand-in for the runner layer's start script.
[ "$#" -eq 0 ] && set -- /runner/dist/main.js
exec "$@"
"""

#: The "runner": prints the names (never the values) of its env, then idles until told to stop.
RUNNER_MAIN_SCRIPT: Final = """#!/bin/sh
# sandbox-lanes test stand-in for the runner (a shell script, not JavaScript).
echo "runner stand-in up: uid=$(id -u) cwd=$(pwd)"
env | cut -d= -f1 | sort | sed 's/^/env-key: /'
trap 'echo "runner stand-in: stopping"; exit 0' TERM INT
while :; do
  sleep 3600 &
  wait $!
done
"""


def unmount_under(root: Path) -> list[str]:
    """Unmount everything mounted at or below ``root`` (deepest first); returns the mount points."""
    prefix = str(Path(root).resolve())
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    return points


class DockerdError(RuntimeError):
    """The engine could not be started, reached or used."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def engine_request(
    socket_path: str,
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> tuple[int, bytes]:
    """One HTTP request to the engine API over its unix socket."""
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request(method, url, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def build_rootfs_tar(busybox: str = DEFAULT_BUSYBOX) -> bytes:
    """A tarball: /bin/busybox plus one symlink per applet, /etc basics and the runner stand-in."""
    if not os.path.isfile(busybox):
        raise DockerdError(f"{busybox} not found (install busybox-static)")
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    buf = io.BytesIO()
    now = int(time.time())

    def add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, now
        tar.addfile(info)

    def add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), mode, now
        tar.addfile(info, io.BytesIO(data))

    def add_link(tar: tarfile.TarFile, name: str, target: str) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, now
        tar.addfile(info)

    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in (
            "bin",
            "usr",
            "usr/bin",
            "etc",
            "root",
            "workspace",
            "proc",
            "sys",
            "dev",
            "runner",
            "runner/bin",
            "runner/dist",
        ):
            add_dir(tar, d, 0o700 if d == "root" else 0o755)
        add_dir(tar, "tmp", 0o1777)
        add_file(tar, "bin/busybox", Path(busybox).read_bytes(), 0o755)
        for applet in applets:
            if applet != "busybox" and "/" not in applet:
                add_link(tar, f"bin/{applet}", "busybox")
        add_link(tar, "usr/bin/env", "/bin/busybox")
        add_file(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        add_file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        add_file(tar, "runner/bin/start", RUNNER_START_SCRIPT.encode(), 0o755)
        add_file(tar, "runner/dist/main.js", RUNNER_MAIN_SCRIPT.encode(), 0o755)
    return buf.getvalue()


class Dockerd:
    """One private dockerd. ``start`` is idempotent; ``stop_engine_only`` keeps the data root
    (images, containers) so a later ``start`` brings the same engine back."""

    def __init__(self, root: str | os.PathLike[str] | None = None, dockerd_bin: str = "dockerd") -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="sl-dockerd-"))
        self.dockerd_bin = dockerd_bin
        self._proc: subprocess.Popen[bytes] | None = None

    # -- locations -----------------------------------------------------------

    @property
    def socket_path(self) -> str:
        return str(self.root / "docker.sock")

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pidfile(self) -> Path:
        return self.root / "docker.pid"

    @property
    def log_path(self) -> Path:
        return self.root / "dockerd.log"

    def command(self) -> list[str]:
        return [
            self.dockerd_bin,
            "--storage-driver=vfs",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--host",
            self.socket_url,
            "--data-root",
            str(self.root / "data"),
            "--exec-root",
            str(self.root / "exec"),
            "--pidfile",
            str(self.pidfile),
        ]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no dockerd log)"

    # -- lifecycle -----------------------------------------------------------

    def ping(self, timeout: float = 2.0) -> bool:
        try:
            status, body = engine_request(self.socket_path, "GET", "/_ping", timeout=timeout)
        except OSError:
            return False
        return status == 200 and body.strip() == b"OK"

    def pid(self) -> int | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid

    def start(self, timeout: float = START_TIMEOUT) -> None:
        if self.ping():
            return
        if os.geteuid() != 0:
            raise DockerdError("dockerd needs root (this harness runs it without rootless mode)")
        path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin"
        for binary in (self.dockerd_bin, "containerd", "runc"):
            if shutil.which(binary, path=path) is None:
                raise DockerdError(f"'{binary}' not found on PATH (Debian package docker.io provides it)")
        self.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PATH": path},
                start_new_session=True,
            )
        except OSError as exc:
            raise DockerdError(f"cannot run {self.dockerd_bin}: {exc}") from exc
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise DockerdError(
                    f"dockerd exited with code {self._proc.returncode} during start-up:\n{self.log_tail()}"
                )
            if self.ping():
                return
            time.sleep(0.2)
        self.stop_engine_only()
        raise DockerdError(f"dockerd did not answer /_ping within {timeout:.0f}s:\n{self.log_tail()}")

    def stop_engine_only(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM dockerd (it stops its containers and its containerd), SIGKILL after ``timeout``."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self._alive(pid):
                time.sleep(0.1)
            if self._alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                while self._alive(pid):
                    time.sleep(0.1)
        self._proc = None

    def _alive(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def stop(self, purge: bool | None = None) -> None:
        """Stop the engine; remove the root too when this object created it (or ``purge``)."""
        self.stop_engine_only()
        if purge if purge is not None else self._own_root:
            unmount_under(self.root)  # dockerd leaves its default netns bind-mounted
            shutil.rmtree(self.root, ignore_errors=True)

    # -- image ---------------------------------------------------------------

    def build_image(self, tag: str = DEFAULT_TAG, busybox: str = DEFAULT_BUSYBOX) -> str:
        """``docker import`` of the busybox rootfs (POST /images/create?fromSrc=-); returns the id."""
        repo, sep, version = tag.rpartition(":")
        if not sep or "/" in version:
            repo, version = tag, "latest"
        changes = [
            'ENTRYPOINT ["/runner/bin/start"]',
            'CMD ["/runner/dist/main.js"]',
            "ENV PATH=/bin:/usr/bin",
            "WORKDIR /workspace",
        ]
        query = "&".join(
            [f"fromSrc=-&repo={_q(repo)}&tag={_q(version)}"] + [f"changes={_q(c)}" for c in changes]
        )
        status, body = engine_request(
            self.socket_path,
            "POST",
            f"/images/create?{query}",
            body=build_rootfs_tar(busybox),
            headers={"Content-Type": "application/x-tar"},
        )
        image_id = ""
        for line in body.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    if msg.get("error"):
                        raise DockerdError(f"image import failed: {msg['error']}")
                    image_id = str(msg.get("status", image_id))
        if status != 200:
            raise DockerdError(f"image import failed: HTTP {status}: {body[:500]!r}")
        return image_id

    def has_image(self, tag: str = DEFAULT_TAG) -> bool:
        try:
            status, _ = engine_request(self.socket_path, "GET", f"/images/{_q(tag)}/json", timeout=10)
        except OSError:
            return False
        return status == 200


def _q(text: str) -> str:
    return quote(text, safe="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.dockerd", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop", "build-image"])
    parser.add_argument("--root", default=DEFAULT_CLI_ROOT, help=f"engine root (default {DEFAULT_CLI_ROOT})")
    parser.add_argument("--tag", default=DEFAULT_TAG)
    parser.add_argument("--busybox", default=DEFAULT_BUSYBOX)
    parser.add_argument("--purge", action="store_true", help="stop: also delete the root")
    args = parser.parse_args(argv)
    engine = Dockerd(args.root)
    try:
        if args.action == "start":
            engine.start()
            print(f"DOCKER_HOST={engine.socket_url}")
        elif args.action == "stop":
            engine.stop(purge=args.purge)
        else:
            engine.start()
            print(f"{args.tag} {engine.build_image(args.tag, args.busybox)}")
    except DockerdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
