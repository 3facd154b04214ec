"""A local stand-in for the pod image's base (``python:3.11-slim-bookworm``), made from Debian packages.

No image registry is reachable here, so the test that builds the repo's Dockerfile needs its base made
on the machine: ``debootstrap`` a minimal Debian bookworm with ``python3`` (3.11), ``python3-venv`` and
``python-is-python3`` from the machine's own apt source, trimmed of docs and locales as the slim image
is. The rootfs tarball is cached outside the repo. On import (``docker import``) the machine's CA bundle
and pip's ``cert`` setting are added, so a ``RUN pip install`` inside the build trusts what the host
trusts (a TLS-inspecting egress proxy included); the Dockerfile itself is built unchanged.

CLI::

    python -m harness.python_base_image prepare     # build the cached rootfs tarball (~80 s cold)
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from harness.cache import cache_root, locked

SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python-is-python3")
#: Bump when the recipe changes, so a cached tarball of an older recipe is rebuilt.
RECIPE = "1"
DEFAULT_TAG = "sandbox-lanes-test/python:3.11-bookworm"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: What the slim image leaves out too.
_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
)


class BaseImageError(RuntimeError):
    """The base rootfs could not be built or imported."""


def tarball_path() -> Path:
    return cache_root() / f"python-{SUITE}-rootfs-r{RECIPE}.tar"


def apt_mirror(sources: Path = Path("/etc/apt")) -> str:
    """The machine's Debian archive URL for ``SUITE`` (deb822 ``.sources`` or one-line ``.list``)."""
    files = sorted((sources / "sources.list.d").glob("*.sources")) + sorted(
        (sources / "sources.list.d").glob("*.list")
    )
    files.append(sources / "sources.list")
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(
                (m.group(1).lower(), m.group(2).split())
                for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
            )
            if "enabled" in fields and fields["enabled"] == ["no"]:
                continue
            if SUITE in fields.get("suites", []) and "deb" in fields.get("types", []):
                return fields["uris"][0]
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return next(p for p in parts[1:] if not p.startswith("["))
    raise BaseImageError(f"no apt source for Debian {SUITE} under {sources}")


def prepare() -> Path:
    """Build the trimmed rootfs tarball once (idempotent, locked) and return its path."""
    target = tarball_path()
    if target.is_file():
        return target
    with locked(target.with_suffix(".lock")):
        if target.is_file():
            return target
        if shutil.which("debootstrap") is None:
            raise BaseImageError("debootstrap not found: install Debian's debootstrap package")
        with tempfile.TemporaryDirectory(prefix="sandbox-lanes-rootfs-") as tmp:
            root = Path(tmp) / "rootfs"
            cmd = [
                "debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                SUITE, str(root), apt_mirror(),
            ]  # fmt: skip
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            if result.returncode != 0:
                tail = (result.stdout + result.stderr)[-3000:]
                raise BaseImageError(f"debootstrap failed ({result.returncode}):\n{tail}")
            for rel in _TRIM:
                shutil.rmtree(root / rel, ignore_errors=True)
            partial = target.with_suffix(".partial")
            subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True, timeout=300)
            partial.replace(target)
    return target


def _with_host_trust(tarball: Path) -> bytes:
    """The cached rootfs plus the host's CA bundle and a pip.conf pointing at it."""
    out = io.BytesIO()
    with tarfile.open(tarball, mode="r:") as src, tarfile.open(fileobj=out, mode="w:") as dst:
        replaced = {"./etc/ssl/certs/ca-certificates.crt", "./etc/pip.conf"}
        for member in src:
            if member.name in replaced:
                continue
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
        extras = {"./etc/pip.conf": b"[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"}
        if HOST_CA_BUNDLE.is_file():
            extras["./etc/ssl/certs/ca-certificates.crt"] = HOST_CA_BUNDLE.read_bytes()
        for name, data in extras.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            dst.addfile(info, io.BytesIO(data))
    return out.getvalue()


def import_base_image(client: Any, tag: str = DEFAULT_TAG) -> str:
    """``docker import`` the base into the engine behind ``client`` (a docker SDK client); returns the tag."""
    repository, _, version = tag.rpartition(":")
    client.api.import_image_from_data(_with_host_trust(prepare()), repository=repository, tag=version)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.python_base_image", description=__doc__)
    parser.add_argument("command", choices=["prepare"])
    parser.parse_args(argv)
    try:
        path = prepare()
    except BaseImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
