"""A TypeScript producer as upstream's would write events: Node 20 with kafkajs, ``@bufbuild/protobuf``'s
``toJson`` (protobuf JSON) and the CloudEvents SDK's Kafka binding (structured mode).

The npm packages are installed once (pinned) into a cache directory beside the harness's others.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.message import Message

from events.codec import type_name
from events.sandbox_lanes.v1 import inputs_pb2

PACKAGES = {"@bufbuild/protobuf": "2.17.0", "kafkajs": "2.2.4", "cloudevents": "10.0.0"}
SCRIPT = Path(__file__).resolve().parent / "node" / "produce_styles.mjs"
_install_lock = threading.Lock()


def _cache() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sandbox-lanes" / "node-producers"
    with _install_lock:
        wanted = {"name": "node-producers", "private": True, "type": "module", "dependencies": PACKAGES}
        manifest = root / "package.json"
        if (
            not manifest.exists()
            or json.loads(manifest.read_text()) != wanted
            or not (root / "node_modules").exists()
        ):
            root.mkdir(parents=True, exist_ok=True)
            manifest.write_text(json.dumps(wanted))
            subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--no-package-lock"],
                cwd=root,
                check=True,
                capture_output=True,
                timeout=300,
            )
    return root


def _json_names(message: descriptor_pb2.DescriptorProto) -> None:
    """Each field's ``json_name`` as protoc writes it (``CopyToProto`` leaves it out; bufbuild reads it)."""
    for field in message.field:
        head, *rest = field.name.split("_")
        field.json_name = head + "".join(part[:1].upper() + part[1:] for part in rest)
    for nested in message.nested_type:
        _json_names(nested)


def _descriptors() -> str:
    """The FileDescriptorSet of the input events' files (and what they import), base64."""
    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(file: object) -> None:
        name = getattr(file, "name")  # noqa: B009
        if name in files:
            return
        for dep in getattr(file, "dependencies"):  # noqa: B009
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        getattr(file, "CopyToProto")(proto)  # noqa: B009
        for message in proto.message_type:
            _json_names(message)
        files[name] = proto

    add(inputs_pb2.DESCRIPTOR)
    return base64.b64encode(
        descriptor_pb2.FileDescriptorSet(file=list(files.values())).SerializeToString()
    ).decode()


@dataclass(frozen=True)
class NodeRecord:
    style: str  # "json" or "structured"
    topic: str
    key: str
    event: Message


def node_produce(bootstrap: str, records: list[NodeRecord]) -> int:
    """Produce ``records`` from Node, in order; the count written."""
    cwd = _cache()
    payload = {
        "bootstrap": bootstrap,
        "descriptors": _descriptors(),
        "records": [
            {
                "style": r.style,
                "topic": r.topic,
                "key": r.key,
                "type": type_name(r.event),
                "id": getattr(r.event, "meta").event_id,  # noqa: B009
                "proto": base64.b64encode(r.event.SerializeToString()).decode(),
            }
            for r in records
        ],
    }
    script = cwd / SCRIPT.name
    shutil.copyfile(SCRIPT, script)  # resolved against the cache's node_modules
    done = subprocess.run(
        ["node", str(script)], cwd=cwd, input=json.dumps(payload), capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"node producer failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["written"])
