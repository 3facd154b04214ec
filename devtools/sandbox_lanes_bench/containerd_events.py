"""What containerd did for each runner pod, and when: the private node's cold-launch steps.

The pod's status shows its sandbox and its container coming up in one update (the kubelet posts
status after the container starts), so the API cannot split them. containerd's own event stream
(``ctr events``, nanosecond stamps) can: the pod sandbox's task started (the kubelet had mounted the
volumes; containerd made the pause container and its network namespace), the runner's container
created (its snapshot), its task started. Only on the bench's private node (``harness.kube_node``),
whose containerd socket the bench knows; a given cluster has no such rows.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: containerd's namespace for the CRI (the kubelet's containers).
CRI_NAMESPACE = "k8s.io"


def _stamp(date: str, clock: str) -> float:
    """``2026-12-05`` ``13:27:55.123456789`` (UTC) -> a wall timestamp (µs kept)."""
    whole, _, fraction = clock.partition(".")
    parsed = dt.datetime.fromisoformat(f"{date}T{whole}.{(fraction + '000000')[:6]}+00:00")
    return parsed.timestamp()


class ContainerdEvents:
    """``ctr events`` for the length of a ``with``: each container id's create and task start."""

    def __init__(self, socket: Path) -> None:
        self._socket = socket
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        #: (topic, container id) -> the wall time containerd stamped on it (the first one)
        self.seen: dict[tuple[str, str], float] = {}
        #: container id -> its labels, read when its first event arrives: by the time the marks are
        #: asked for, the sandboxes are torn down and containerd may have removed their containers
        #: (the runner's before the pod sandbox's), so a lookup then finds nothing
        self.labels: dict[str, dict[str, str]] = {}

    def __enter__(self) -> ContainerdEvents:
        self._proc = subprocess.Popen(
            ["ctr", "--address", str(self._socket), "events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, name="bench-ctr-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            # the reader may be inside a label lookup (its own 30 s bound): marks() must not run
            # beside it
            self._thread.join(timeout=35)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            # 2026-12-05 13:27:55.123456789 +0000 UTC k8s.io /tasks/start {"container_id":"...",...}
            parts = line.split(" ", 6)
            if len(parts) < 7 or parts[4] != CRI_NAMESPACE:
                continue
            topic = parts[5]
            if topic not in ("/containers/create", "/tasks/start"):
                continue
            try:
                body = json.loads(parts[6])
                at = _stamp(parts[0], parts[1])
            except ValueError:
                continue
            container = str(body.get("container_id") or body.get("id") or "")
            if container:
                self.seen.setdefault((topic, container), at)
                if not self.labels.get(container):
                    self.labels[container] = self._labels(container)

    def marks(self, pods: Mapping[str, str], offset: float) -> dict[str, dict[str, float]]:
        """By sandbox id (``pods``: pod name -> sandbox id): ``sandbox_started`` (the pod sandbox's
        task), ``container_created`` and ``container_started`` (the runner's), monotonic."""
        marks: dict[str, dict[str, float]] = {}
        for (topic, container), at in list(self.seen.items()):
            labels = self.labels.get(container) or self._labels(container)
            sandbox_id = pods.get(labels.get("io.kubernetes.pod.name", ""))
            if sandbox_id is None:
                continue
            kind = labels.get("io.cri-containerd.kind")
            step = {
                ("sandbox", "/tasks/start"): "sandbox_started",
                ("container", "/containers/create"): "container_created",
                ("container", "/tasks/start"): "container_started",
            }.get((str(kind), topic))
            if step is not None:
                marks.setdefault(sandbox_id, {})[step] = at - offset
        return marks

    def _labels(self, container: str) -> dict[str, str]:
        """The container's labels, {} when containerd cannot say (gone, or too slow: a later event or
        ``marks`` asks again; the reader thread must not end on it)."""
        try:
            info = subprocess.run(
                ["ctr", "--address", str(self._socket), "-n", CRI_NAMESPACE, "containers", "info", container],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (subprocess.TimeoutExpired, OSError):
            return {}
        if info.returncode != 0:
            return {}
        try:
            found: Any = json.loads(info.stdout).get("Labels") or {}
        except ValueError:
            return {}
        return {str(k): str(v) for k, v in found.items()}
