"""Packaging: the Dockerfile, compose/docker-compose.yml and the Kubernetes manifests.

* The compose file is validated by the real Compose (`docker compose config`, or Debian's
  `docker-compose config`; scripts/bootstrap.sh installs it), and its pod + producer flow is run
  for real: `sandbox-lanes run` with the compose pod's environment against the real Kafka broker,
  then `sandbox-lanes produce compose/producer/sample-events.yaml` and `sandbox-lanes tail`.
* The manifests are each kustomize overlay as `kubectl kustomize` renders it (the harness's kubectl,
  built with the apiserver), server-side dry-run applied (strict field validation) against the real
  kube-apiserver, and the pod template is dry-run created as a Pod in the namespace that enforces
  the `restricted` Pod Security Standard. (tests/integration/test_kubernetes_deploy.py applies them for real.)
* Every environment name in the compose file and the Deployment is a row of the config table, and
  the values they set pass ``load_settings``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from consumers.ops.settings import SETTINGS, load_settings
from consumers.runtime.kafka.topology import Topics
from events.sandbox_lanes.v1 import outcomes_pb2
from tests.integration.test_ops_http import free_port, wait_for_status
from tests.support.pod_harness import STUB_RUNNER, PodProcess, read_topic, unique_env
from tests.support.proc_util import processes_under

pytestmark = pytest.mark.usefixtures("no_leftover_pods")  # tests/support/fixtures/pods.py

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
K8S_DIR = ROOT / "compose" / "kubernetes"
#: One overlay per Kubernetes driver, named by its SANDBOX_PROVISIONER_TYPE.
K8S_OVERLAYS = ("kubernetes", "agent-sandbox")
KNOWN_ENV = {s.env for s in SETTINGS}


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is not None:
        return [legacy]
    pytest.fail(
        "neither `docker compose` nor `docker-compose` is installed (scripts/bootstrap.sh installs it)"
    )


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    """The compose file as the real Compose normalizes it (``config`` fails on an invalid file)."""
    proc = subprocess.run(
        [*compose_command(), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    config: dict[str, Any] = yaml.safe_load(proc.stdout)
    return config


def manifests(overlay: str = "kubernetes") -> list[dict[str, Any]]:
    """The overlay as ``kubectl apply -k`` sends it (``kubectl kustomize``, no cluster needed)."""
    from harness.kube_apiserver import kubectl_path

    proc = subprocess.run(
        [str(kubectl_path()), "kustomize", str(K8S_DIR / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def deployment(overlay: str = "kubernetes") -> dict[str, Any]:
    (dep,) = [d for d in manifests(overlay) if d["kind"] == "Deployment"]
    return dep


# --- Dockerfile ------------------------------------------------------------------------------------


def test_the_dockerfile_is_slim_multi_stage_and_runs_the_pod_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [
        line.split(None, 1) for line in text.splitlines() if line and not line.startswith((" ", "#"))
    ]
    words = [i[0] for i in instructions]
    args = dict(i[1].split("=", 1) for i in instructions if i[0] == "ARG" and "=" in i[1])
    assert "-slim" in args.get("PYTHON_IMAGE", ""), args
    # The base pinned by digest; version and revision are build arguments, the OCI labels show them.
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", args["PYTHON_IMAGE"]), args
    assert {"VERSION", "REVISION"} <= set(args)
    assert 'org.opencontainers.image.revision="${REVISION}"' in text
    assert "site-packages/consumers" not in text  # nothing deleted after the install: no bench in the wheel
    assert words.count("FROM") == 2  # build stage + runtime stage: no compiler or pip cache in the image
    users = [i[1] for i in instructions if i[0] == "USER"]
    assert users == ["10001:10001"]  # numeric, so runAsNonRoot can verify it
    assert words.index("USER") > max(n for n, w in enumerate(words) if w in ("RUN", "COPY"))
    assert 'ENTRYPOINT ["sandbox-lanes"]' in text and 'CMD ["run"]' in text
    assert "EXPOSE 8080" in text and "HEALTHCHECK" in text and "/healthz" in text
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("**")] == "**"  # everything is excluded unless listed (.venv, .git, tests)
    copied = {i[1].split()[0] for i in instructions if i[0] == "COPY" and "--from" not in i[1]}
    for source in copied:
        assert f"!{source.rstrip('/')}/" in ignore or f"!{source}" in ignore, source
    # `pip install .` in the build stage needs every package pyproject lists (a missing one fails the build).
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {p.split(".")[0] for p in packages} <= copied, copied


# --- compose ---------------------------------------------------------------------------------------


def test_the_compose_file_validates_with_kafka_in_kraft_mode(compose_config: dict[str, Any]) -> None:
    services = compose_config["services"]
    assert set(services) == {"kafka", "topics", "pod", "producer", "outcomes"}
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft: no ZooKeeper anywhere
    assert "zookeeper" not in json.dumps(compose_config).lower()
    assert kafka["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"  # exactly_once on one node
    pod = services["pod"]
    assert pod["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert pod["depends_on"]["topics"]["condition"] == "service_completed_successfully"  # inputs first
    assert services["topics"]["command"] == ["topics", "--apply"]
    assert services["producer"]["depends_on"]["pod"]["condition"] == "service_healthy"
    assert "/readyz" in json.dumps(pod["healthcheck"]["test"])
    for service in services.values():
        for port in service.get("ports", []):
            published = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}"
            assert published.startswith("127.0.0.1:"), port  # nothing is exposed beyond the laptop


def test_every_compose_env_name_is_a_config_row_and_the_values_are_valid(
    compose_config: dict[str, Any],
) -> None:
    for name in ("topics", "pod", "producer", "outcomes"):
        env = {k: str(v) for k, v in compose_config["services"][name]["environment"].items()}
        assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
        settings = load_settings(env)
        assert settings.bootstrap == "kafka:9092"
    pod_settings = load_settings(
        {k: str(v) for k, v in compose_config["services"]["pod"]["environment"].items()}
    )
    assert (pod_settings.provisioner_type, pod_settings.http_port) == ("local-process", 8080)


@pytest.mark.kafka
async def test_the_compose_flow_runs_on_the_real_broker(
    compose_config: dict[str, Any], kafka_bootstrap: str, tmp_path: Path
) -> None:
    """What `docker compose up` does, minus the containers: the pod, the sample producer, the tail."""
    pod_env = {k: str(v) for k, v in compose_config["services"]["pod"]["environment"].items()}
    isolated = unique_env(kafka_bootstrap, tmp_path)  # own topics, group and driver state dir
    env = {
        **pod_env,
        **{k: v for k, v in isolated.items() if k.startswith("SANDBOX_LANES_TOPIC_")},
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SANDBOX_LANES_GROUP_ID": isolated["SANDBOX_LANES_GROUP_ID"],
        "SANDBOX_LANES_DRIVER_OPTIONS": isolated["SANDBOX_LANES_DRIVER_OPTIONS"],
        "STIGMER_SANDBOX_RUNNER_COMMAND": STUB_RUNNER,  # the image's `python` is this interpreter here
        "SANDBOX_LANES_HTTP_HOST": "127.0.0.1",
        "SANDBOX_LANES_HTTP_PORT": str(free_port()),
    }
    topics: Topics = load_settings(env).topics
    applied = _cli(env, *compose_config["services"]["topics"]["command"])  # the topics service
    assert applied.returncode == 0 and len(applied.stdout.splitlines()) == 7, applied.stderr
    pod = PodProcess(env, tmp_path / "pod.log")
    pod.start()
    try:
        await pod.wait_for_log("state restored")
        await wait_for_status(int(env["SANDBOX_LANES_HTTP_PORT"]), "/readyz", 200)
        producer_cmd = compose_config["services"]["producer"]["command"]
        sample = ROOT / "compose" / "producer" / Path(producer_cmd[1]).name
        produced = _cli(env, producer_cmd[0], str(sample))
        assert produced.returncode == 0 and "produced 5 events" in produced.stdout, produced.stderr
        outcomes = await read_topic(kafka_bootstrap, topics.outcomes, at_least=4, timeout_s=60)
        kinds = sorted((type(r.message).__name__, r.key) for r in outcomes)
        assert kinds == [
            ("SandboxDeprovisioned", "ses_sample_1"),
            ("SandboxDeprovisioned", "wfx_sample_1"),
            ("SandboxProvisioned", "axr_sample_1"),
            ("SandboxProvisioned", "wfx_sample_1"),
        ], pod.log()[-3000:]
        assert all(
            r.message.sandbox.driver == "local-process"
            for r in outcomes
            if isinstance(r.message, outcomes_pb2.SandboxProvisioned)
        )
        tail_cmd = compose_config["services"]["outcomes"]["command"]
        assert tail_cmd == ["tail", "--follow"]
        tailed = _cli(env, "tail", "--idle-timeout", "2")  # the outcomes service, bounded
        lines = [json.loads(line) for line in tailed.stdout.splitlines()]
        assert len(lines) == 4 and all(line["topic"] == topics.outcomes for line in lines), tailed.stderr
    finally:
        code, _ = pod.terminate()
    assert code == 0
    assert processes_under(tmp_path) == []  # both sandboxes were torn down by the flow itself


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", *argv],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


# --- Kubernetes manifests ----------------------------------------------------------------------------


@pytest.mark.kubernetes  # kubectl comes from the kubernetes build
@pytest.mark.parametrize("overlay", K8S_OVERLAYS)
def test_the_deployment_has_probes_resources_the_metrics_port_and_known_env(overlay: str) -> None:
    dep = deployment(overlay)
    template = dep["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert set(container["resources"]) == {"requests", "limits"}
    assert template["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8080",
        "prometheus.io/path": "/metrics",
    }
    names = [e["name"] for e in container["env"]]
    assert set(names) <= KNOWN_ENV, set(names) - KNOWN_ENV
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = load_settings(values)  # the Deployment's values pass validation
    assert settings.provisioner_type == overlay and settings.http_port == 8080
    # The Kafka credentials come from the generated Secret, each key optional.
    kafka = [e for e in container["env"] if e["name"].startswith(("KAFKA_SASL_", "KAFKA_SSL_"))]
    assert kafka and all(e["valueFrom"]["secretKeyRef"]["optional"] for e in kafka)
    (secret,) = [d for d in manifests(overlay) if d["kind"] == "Secret"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in kafka} == {secret["metadata"]["name"]}
    # A released tag (the project's version), not :latest.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"] == f"sandbox-lanes:{version}"
    # The kubernetes driver needs a per-queue routing mode, or the pod refuses to boot.
    assert (settings.agent.activity_routing, settings.workflow.workflow_activity_routing) == (
        "session",
        "execution",
    )
    # Liveness is the loop turning (no driver call runs in it, however slow): the probe restarts a
    # pod only after the loop has been stalled for the whole stall window and more.
    probe = container["livenessProbe"]
    assert probe["httpGet"]["path"] == "/healthz"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= settings.stall_seconds
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_timeout_s
    (service,) = [d for d in manifests(overlay) if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert "annotations" not in service["metadata"]  # one scrape path: the Pod's annotations


@pytest.mark.kubernetes
@pytest.mark.parametrize("overlay", K8S_OVERLAYS)
def test_the_manifests_pass_a_server_side_dry_run(kube_admin: Any, overlay: str) -> None:
    from kubernetes import dynamic

    dyn = dynamic.DynamicClient(kube_admin)
    strict = [("fieldValidation", "Strict")]

    def apply(doc: dict[str, Any], *, dry_run: bool) -> Any:
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        return dyn.server_side_apply(
            resource,
            body=doc,
            namespace=doc["metadata"].get("namespace"),
            field_manager="sandbox-lanes-test",
            force_conflicts=True,
            dry_run="All" if dry_run else None,
            query_params=list(strict),
        )

    docs = manifests(overlay)
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "Secret",
        "NetworkPolicy",
        "LimitRange",
        "ResourceQuota",
    }
    # Namespaced objects can only be dry-run into namespaces that exist: apply those two for real.
    for doc in docs:
        if doc["kind"] in ("Namespace", "ServiceAccount"):
            apply(doc, dry_run=False)
    for doc in docs:
        applied = apply(doc, dry_run=True)
        assert applied.metadata.name == doc["metadata"]["name"]
    # The namespace enforces the restricted Pod Security Standard: the pod template must pass it.
    template = deployment(overlay)["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sandbox-lanes-dry-run", **template["metadata"]},
    }
    pod["spec"] = template["spec"]
    pods = dyn.resources.get(api_version="v1", kind="Pod")
    created = dyn.create(pods, body=pod, namespace="sandbox-lanes", dry_run="All", query_params=list(strict))
    assert created.spec.containers[0].ports[0].name == "metrics"
    # The control: the same pod with privilege escalation allowed is refused, so the check is real.
    from kubernetes.client.exceptions import ApiException

    loose = copy.deepcopy(pod)
    loose["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    with pytest.raises(ApiException) as refused:
        dyn.create(pods, body=loose, namespace="sandbox-lanes", dry_run="All")
    assert refused.value.status == 403 and "restricted" in str(refused.value.body)
