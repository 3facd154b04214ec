"""No runner token anywhere but the sandbox: logs, topics, metrics, process lists.

`sandbox-lanes run` with STIGMER_RUNNER_TOKEN_KEY set, on real Kafka, with the real
local-process driver and the real docker driver. The tokens actually minted are
recovered from the sandboxes themselves (/proc/<pid>/environ, the container's
Config.Env), then searched for in every byte the pod exposed: its log, every
topic's raw records (keys, values, headers, aborted transactions included), the
/metrics page, the output of `reap` and `replay`, and /proc/*/cmdline of every
process on the machine while the sandboxes run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import secrets
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from consumers.ops.settings import load_settings
from consumers.tools.embedded_broker import free_port
from drivers.naming import LABEL_SANDBOX_ID
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.pod_harness import (
    ROOT,
    PodProcess,
    Received,
    produce,
    read_topic,
    unique_env,
    wf_created,
    wf_terminal,
)
from tests.support.proc_util import runner_pids

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leaked_runners")]
RUN = uuid.uuid4().hex[:8]
JWT = re.compile(rb"eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}")


def _all_cmdlines() -> bytes:
    chunks = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                chunks.append((entry / "cmdline").read_bytes())
    return b"\n".join(chunks)


def _raw(records: list[Received]) -> bytes:
    out = []
    for r in records:
        out.append(r.key.encode())
        out.append(r.value or b"")
        out.extend(f"{k}={v}".encode() for k, v in r.headers.items())
    return b"\n".join(out)


def _token_from_proc(task_queue: str) -> str:
    (pid,) = runner_pids(task_queue)
    env = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    return env[b"STIGMER_TOKEN"].decode()


def _cli(env: dict[str, str], *args: str) -> bytes:
    proc = subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("driver", ["local-process", "docker"])
async def test_no_token_in_any_log_event_metric_or_process_list(
    kafka_bootstrap: str, tmp_path: Path, driver: str, request: pytest.FixtureRequest
) -> None:
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    port = free_port()
    extra: dict[str, str] = {}
    client: Any = None
    if driver == "docker":
        dockerd = request.getfixturevalue("dockerd")
        image = request.getfixturevalue("docker_image")
        client = docker.DockerClient(base_url=dockerd.socket_url, version="auto")
        extra = {
            "SANDBOX_PROVISIONER_TYPE": "docker",
            "SANDBOX_LANES_DRIVER_OPTIONS": f"docker_host={dockerd.socket_url},image={image},network=none",
            "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://127.0.0.1:7234",
            "STIGMER_SANDBOX_TEMPORAL_ADDRESS": "127.0.0.1:7233",
        }
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        STIGMER_RUNNER_TOKEN_KEY=key,
        SANDBOX_LANES_HTTP_HOST="127.0.0.1",
        SANDBOX_LANES_HTTP_PORT=str(port),
        SANDBOX_LANES_REAP_INTERVAL_S="0",
        **extra,
    )
    topics = load_settings(env).topics
    wf, axr, ses = f"wfx_sec_{RUN}_{driver}", f"axr_sec_{RUN}_{driver}", f"ses_sec_{RUN}_{driver}"
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("state restored")
        await produce(
            kafka_bootstrap,
            env,
            inputs_pb2.ExecutionCreated(
                meta=new_meta(), kind=common_pb2.WORKFLOW_EXECUTION, execution_id=wf,
                workflow_execution_target=common_pb2.CLOUD, caller_identity_id="ida_sec",
            ),
            inputs_pb2.ExecutionCreated(
                meta=new_meta(), kind=common_pb2.AGENT_EXECUTION, execution_id=axr, session_id=ses,
                session_execution_target=common_pb2.CLOUD, caller_identity_id="ida_sec",
            ),
        )  # fmt: skip
        provisioned = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
        assert all(getattr(r.message, "token_minted", False) for r in provisioned), provisioned
        # The tokens really minted, recovered from the sandboxes themselves.
        if driver == "local-process":
            tokens = [_token_from_proc(f"wfexec:{wf}"), _token_from_proc(f"session:{ses}")]
        else:
            tokens = []
            for sid in (wf, ses):
                (container,) = client.containers.list(filters={"label": f"{LABEL_SANDBOX_ID}={sid}"})
                env_list = container.attrs["Config"]["Env"]
                tokens.append(next(v.split("=", 1)[1] for v in env_list if v.startswith("STIGMER_TOKEN=")))
        assert len(tokens) == 2 and all(t.count(".") == 2 for t in tokens), "no real JWT reached a sandbox"
        cmdlines = _all_cmdlines()  # while the pod and both sandboxes run
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        )
        assert b"sandbox_lanes_outputs" in metrics
        await produce(
            kafka_bootstrap,
            env,
            inputs_pb2.PhaseChanged(
                meta=new_meta(), kind=common_pb2.WORKFLOW_EXECUTION, execution_id=wf,
                previous_phase=common_pb2.EXECUTION_IN_PROGRESS, new_phase=common_pb2.EXECUTION_COMPLETED,
            ),
            inputs_pb2.SessionDeleted(meta=new_meta(), session_id=ses),
        )  # fmt: skip
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=4)
        metrics += await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        )
    finally:
        code, _ = await asyncio.to_thread(pod.terminate)
        if client is not None:
            for c in client.containers.list(all=True):
                if c.labels.get(LABEL_SANDBOX_ID, "").startswith(("wfx_sec_", "ses_sec_")):
                    c.remove(force=True)
            client.close()
    assert code == 0
    tools = _cli(env, "reap", "--log-level", "debug") + _cli(env, "replay", "--log-level", "debug")
    everything = {
        "pod log": pod.log_path.read_bytes(),
        "process list": cmdlines,
        "metrics": metrics,
        "reap/replay output": tools,
    }
    for topic in (*topics.inputs, topics.outcomes, topics.state, topics.dead_letter):
        records = await read_topic(
            kafka_bootstrap, topic, settle_s=0.5, timeout_s=10, isolation_level="read_uncommitted"
        )
        everything[f"topic {topic}"] = _raw(records)
    assert b"pod started" in everything["pod log"] and everything[f"topic {topics.outcomes}"]
    for where, data in everything.items():
        for token in tokens:
            signature = token.rsplit(".", 1)[1]
            assert token.encode() not in data, f"a runner token is in the {where}"
            assert signature.encode() not in data, f"a runner token's signature is in the {where}"
        assert key.encode() not in data and base64.b64decode(key) not in data, (
            f"the signing key is in the {where}"
        )
        assert JWT.search(data) is None, f"something JWT-shaped is in the {where}: {JWT.search(data)}"


async def test_no_pod_secret_reaches_a_local_process_runner_but_the_temporal_connection_does(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The local-process runner inherits the pod's environment (as upstream's does) minus the pod's
    own secrets: the signing key, the file it was read from, every secret setting. The contract
    itself (queue, token, endpoints) still arrives. A key loaded from its file is redacted like one
    given in the variable."""
    from consumers.ops.settings import RUNNER_WITHHELD_ENV

    key = base64.b64encode(secrets.token_bytes(32)).decode()
    key_file = tmp_path / "token-key"
    key_file.write_text(key + "\n")
    ca_file = tmp_path / "temporal-ca.pem"
    ca_pem = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
    ca_file.write_text(ca_pem)
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        STIGMER_RUNNER_TOKEN_KEY_FILE=str(key_file),
        SANDBOX_LANES_REAP_INTERVAL_S="0",
        # The pod's own Temporal connection: the runner gets it re-rendered (PEM as _DATA).
        STIGMER_TEMPORAL_API_KEY="temporal-api-key-123",
        STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(ca_file),
    )
    assert key in load_settings(env).secret_values  # what the log formatter scrubs
    assert {"STIGMER_RUNNER_TOKEN_KEY", "STIGMER_RUNNER_TOKEN_KEY_FILE"} <= RUNNER_WITHHELD_ENV
    topics = load_settings(env).topics
    wf = f"wfx_sec_env_{RUN}"
    pod = PodProcess({**env, "STIGMER_RUNNER_TOKEN_KEY": ""}, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("state restored")
        await produce(kafka_bootstrap, env, wf_created(wf))
        provisioned = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        assert getattr(provisioned[0].message, "token_minted", False), provisioned
        (pid,) = runner_pids(f"wfexec:{wf}")
        runner_env = dict(
            item.split(b"=", 1)
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in item
        )
        await produce(kafka_bootstrap, env, wf_terminal(wf))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
    finally:
        code, _ = await asyncio.to_thread(pod.terminate)
    assert code == 0
    names = {k.decode() for k in runner_env}
    assert names & RUNNER_WITHHELD_ENV == set(), names & RUNNER_WITHHELD_ENV
    assert not any(key.encode() in v or str(key_file).encode() in v for v in runner_env.values())
    # The upstream contract is intact, and the pod's other (non-secret) settings still pass on.
    assert runner_env[b"STIGMER_TASK_QUEUE"] == f"wfexec:{wf}".encode()
    assert runner_env[b"STIGMER_TOKEN"].count(b".") == 2
    assert runner_env[b"KAFKA_BOOTSTRAP_SERVERS"] == kafka_bootstrap.encode()
    # The server's Temporal connection settings, as upstream hands them over (spec 1.2.7, 5.1).
    assert runner_env[b"STIGMER_TEMPORAL_API_KEY"] == b"temporal-api-key-123"
    assert runner_env[b"STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_DATA"] == ca_pem.encode()
    assert b"STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH" not in runner_env
    assert b"temporal-api-key-123" not in pod.log_path.read_bytes()
    assert key.encode() not in pod.log_path.read_bytes()


async def test_sandbox_lanes_run_loads_an_operators_credential_provider_by_entry_point(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """SANDBOX_LANES_CREDENTIAL_PROVIDER names an installed ``sandbox_lanes.credentials`` entry point
    (here the dev harness's capability provider): it makes the whole mint decision for the runner."""
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_LANES_CREDENTIAL_PROVIDER="test-capability",
        TEST_CAPABILITY_PREFIX="op-token",
        SANDBOX_LANES_REAP_INTERVAL_S="0",
    )
    topics = load_settings(env).topics
    wf = f"wfx_sec_cap_{RUN}"
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("state restored")
        await produce(kafka_bootstrap, env, wf_created(wf))
        (provisioned,) = await read_topic(kafka_bootstrap, topics.outcomes, at_least=1)
        assert getattr(provisioned.message, "token_minted", False), provisioned
        (pid,) = runner_pids(f"wfexec:{wf}")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        await produce(kafka_bootstrap, env, wf_terminal(wf))
        await read_topic(kafka_bootstrap, topics.outcomes, at_least=2)
    finally:
        code, _ = await asyncio.to_thread(pod.terminate)
    assert code == 0
    assert f"STIGMER_TOKEN=op-token-workflow-{wf}".encode() in environ
    assert "test capability provider loaded" in pod.log()
