"""Build and run Toxiproxy (Shopify's TCP fault proxy) for the network-fault tests.

Standard library only::

    python -m harness.toxiproxy build     # compile the server once into the cache (idempotent)
    python -m harness.toxiproxy path      # print the binary path

Build
    ``go install github.com/Shopify/toxiproxy/v2/cmd/server@VERSION`` through the Go module
    proxy (``GOBIN`` a scratch directory in the cache; ``nice -n 19``, ``-p 2``), renamed to
    ``toxiproxy-server`` in ``$SANDBOX_LANES_CACHE/toxiproxy-<VERSION>/``. The binary's
    presence marks a finished build, so later runs need neither the network nor the toolchain.

Run (``ToxiproxyServer``)
    ``toxiproxy-server -host 127.0.0.1 -port P`` (P a free loopback port); ``start()`` returns
    when ``GET /version`` answers. ``Toxiproxy`` is a small client of its HTTP API: create a
    proxy (listen and upstream both on 127.0.0.1), add / remove toxics, enable / disable a
    proxy (disabled: new connections refused and open ones closed). ``stop()`` sends SIGTERM,
    then SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

from harness.cache import cache_root, locked
from harness.kube_apiserver import _free_port, _go_env, _run, _tail, _terminate

VERSION: Final = "v2.5.0"
PACKAGE: Final = "github.com/Shopify/toxiproxy/v2/cmd/server"
BINARY: Final = "toxiproxy-server"
HOST: Final = "127.0.0.1"


# --------------------------------------------------------------------------- build


def build_dir() -> Path:
    return cache_root() / f"toxiproxy-{VERSION}"


def binary_path() -> Path:
    return build_dir() / BINARY


def is_built() -> bool:
    binary = binary_path()
    return binary.is_file() and os.access(binary, os.X_OK)


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").is_file() else None)
    if go is None:
        raise SystemExit("the go toolchain is required to build toxiproxy (PATH needs /usr/local/go/bin)")
    return go


def build() -> Path:
    """Compile the server into ``build_dir()`` (skipped when already there); returns the binary."""
    out = build_dir()
    if is_built():
        print(f"toxiproxy {VERSION} already built: {binary_path()}", flush=True)
        return binary_path()
    go = _go()
    out.mkdir(parents=True, exist_ok=True)
    with locked(out.parent / f"toxiproxy-{VERSION}.lock"):
        if is_built():  # another run built it while we waited for the lock
            return binary_path()
        started = time.monotonic()
        gobin = out / "gobin"
        shutil.rmtree(gobin, ignore_errors=True)
        gobin.mkdir()
        env = _go_env()
        env.pop("GOFLAGS", None)  # -mod=mod is meaningless for `go install pkg@version`
        env["GOBIN"] = str(gobin)
        _run(
            [
                *(["nice", "-n", "19"] if shutil.which("nice") else []),
                go,
                "install",
                "-p",
                "2",
                "-trimpath",
                "-ldflags=-s -w",
                f"{PACKAGE}@{VERSION}",
            ],
            out,
            env,
        )
        built = gobin / "server"
        built.chmod(0o755)
        built.replace(binary_path())  # last: the binary's presence marks a finished build
        shutil.rmtree(gobin, ignore_errors=True)
        elapsed = time.monotonic() - started
    print(f"built toxiproxy-server {VERSION} in {elapsed:.0f}s: {binary_path()}", flush=True)
    return binary_path()


# --------------------------------------------------------------------------- client


class Toxiproxy:
    """A client of one server's HTTP API (``http://127.0.0.1:<port>``)."""

    def __init__(self, api_port: int) -> None:
        self.base = f"http://{HOST}:{api_port}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"toxiproxy {method} {path}: {exc.code} {exc.read().decode(errors='replace')}"
            ) from exc
        return json.loads(raw) if raw.strip() else None

    def version(self) -> str:
        req = urllib.request.Request(self.base + "/version")
        with urllib.request.urlopen(req, timeout=2) as resp:
            text: str = resp.read().decode().strip()
            return text

    def create_proxy(self, name: str, listen_port: int, upstream_port: int) -> None:
        self._call(
            "POST",
            "/proxies",
            {
                "name": name,
                "listen": f"{HOST}:{listen_port}",
                "upstream": f"{HOST}:{upstream_port}",
                "enabled": True,
            },
        )

    def proxies(self) -> dict[str, Any]:
        found: dict[str, Any] = self._call("GET", "/proxies")
        return found

    def set_enabled(self, name: str, enabled: bool) -> None:
        self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    def add_toxic(
        self, proxy: str, name: str, kind: str, attributes: dict[str, int], stream: str = "downstream"
    ) -> None:
        """One toxic (``latency``, ``timeout``, ``reset_peer``, ``bandwidth``, ...) on one direction."""
        self._call(
            "POST",
            f"/proxies/{proxy}/toxics",
            {"name": name, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes},
        )

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def reset(self) -> None:
        """Every proxy enabled, every toxic removed (``POST /reset``)."""
        self._call("POST", "/reset")


# --------------------------------------------------------------------------- server


class ToxiproxyServer:
    """One ``toxiproxy-server`` process on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.api_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "toxiproxy.log"

    @property
    def client(self) -> Toxiproxy:
        return Toxiproxy(self.api_port)

    def start(self, timeout: float = 15.0) -> Toxiproxy:
        binary = build() if not is_built() else binary_path()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api_port = _free_port()
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "-host", HOST, "-port", str(self.api_port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"toxiproxy-server exited ({self.proc.returncode}):\n{_tail(self.log)}")
            try:
                self.client.version()
                return self.client
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"toxiproxy-server did not answer within {timeout}s:\n{_tail(self.log)}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _terminate(self.proc.pid)
        self.proc = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.toxiproxy")
    parser.add_argument("command", choices=["build", "path"])
    args = parser.parse_args(argv)
    if args.command == "build":
        build()
    else:
        if not is_built():
            print("not built: run `python -m harness.toxiproxy build`", file=sys.stderr)
            return 1
        print(binary_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
