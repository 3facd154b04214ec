"""A one-layer image as a ``docker save`` archive, for ``ctr images import`` (no registry, no engine).

The test node's containerd gets its images this way: the pause image and the runner
stand-in are the busybox rootfs of ``harness.dockerd`` with another entrypoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Sequence


def docker_archive(
    layer: bytes,
    tag: str,
    *,
    entrypoint: Sequence[str],
    cmd: Sequence[str] = (),
    env: Sequence[str] = ("PATH=/bin:/usr/bin",),
    workdir: str = "/",
) -> bytes:
    """A docker-archive tarball (manifest.json + config + one layer) naming ``tag``."""
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(entrypoint),
            "Cmd": list(cmd),
            "Env": list(env),
            "WorkingDir": workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "sandbox-lanes test harness"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    layer_name = diff_id.removeprefix("sha256:") + "/layer.tar"
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": [layer_name]}]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (
            (config_name, config_bytes),
            (layer_name, layer),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
