"""The shipped alerts and dashboard, proven on real parts (issue 36).

* ``promtool check rules`` on the rule groups of the shipped PrometheusRule
  (compose/kubernetes/components/prometheus-rule/), and the dashboard component's shape.
* A real Prometheus (Debian's ``prometheus`` package, scripts/bootstrap.sh installs it) scrapes a
  running pod on the real broker every second and evaluates the shipped rules every second, loaded
  with their ``for:`` removed (a 10-minute ``for:`` would only delay the verdict; each rule's
  expression and templates are evaluated as shipped). Through its HTTP API: no alert is active after a
  healthy run; then one scenario per alert, each made to trigger it, and after each the set of firing
  alerts is exactly the ones triggered so far; finally every query of the shipped dashboard returns
  series.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from harness.memory_driver import MemoryProvisioner

from consumers.ops.http_server import OpsServer
from consumers.ops.reaper import reaper_for
from consumers.ops.settings import load_settings
from consumers.tools.embedded_broker import free_port
from drivers.agent_sandbox.warm_pool import WarmPoolMetrics
from events.codec import new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.integration.test_ops_http import agent_created, wait_for_status
from tests.support.pod_harness import (
    ROOT,
    produce,
    produce_raw,
    read_topic,
    running_pod,
    unique_env,
    wf_created,
)

COMPONENTS = ROOT / "compose" / "kubernetes" / "components"
RULE = COMPONENTS / "prometheus-rule" / "prometheusrule.yaml"
DASHBOARD_DIR = COMPONENTS / "grafana-dashboard"
DASHBOARD = DASHBOARD_DIR / "sandbox-lanes-dashboard.json"
#: What the dashboard's ``$__rate_interval`` stands for here (Grafana sets it from the scrape interval
#: and the panel's resolution); the whole test fits in it.
RATE_INTERVAL = "5m"


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULE.read_text())["spec"]["groups"]
    return groups


def alert_rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression with ``$__rate_interval`` substituted) of every target."""
    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for panel in board["panels"]
        for target in panel["targets"]
    ]


def test_promtool_checks_the_shipped_rules_and_the_dashboard_component(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/bootstrap.sh installs Debian's prometheus package"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout, done.stdout

    # The component: the JSON file itself, in a ConfigMap the Grafana sidecar picks up.
    component = yaml.safe_load((DASHBOARD_DIR / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    (generator,) = component["configMapGenerator"]
    assert generator["files"] == [DASHBOARD.name]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    assert generator["options"]["disableNameSuffixHash"] is True
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "sandbox-lanes" and len(dashboard_queries()) >= 16
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


# --- a real Prometheus ----------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def close(self) -> None:
        await self._session.close()

    async def api(self, path: str, **params: str) -> Any:
        async with self._session.get(f"{self.base}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def until(self, what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            last = await check()
            if last:
                return last
            await asyncio.sleep(0.25)
        raise AssertionError(f"{what}: not in {timeout_s}s (last {last!r})")

    async def active_alerts(self) -> dict[str, str]:
        """Alert name -> state (pending or firing) of every active alert."""
        alerts = (await self.api("alerts"))["alerts"]
        return {a["labels"]["alertname"]: a["state"] for a in alerts}

    async def rules_evaluated_after(self, at: float) -> None:
        """Wait for a whole evaluation of every group that started after ``at`` (unix seconds)."""

        async def evaluated() -> bool:
            groups = (await self.api("rules"))["groups"]
            stamps = [_unix(g["lastEvaluation"]) for g in groups]
            return bool(stamps) and min(stamps) > at

        await self.until("a rule evaluation after the scrape", evaluated, timeout_s=30)


def _unix(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


@asynccontextmanager
async def prometheus(tmp_path: Path, target_port: int) -> AsyncIterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus missing: scripts/bootstrap.sh installs Debian's prometheus package"
    groups = rule_groups()
    for group in groups:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule.pop("for", None)  # evaluated as their expression: see the module docstring
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "scrape_configs": [
            {
                "job_name": "sandbox-lanes",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{target_port}"],
                        # What the Kubernetes service discovery of a real install adds (the rules
                        # aggregate by them).
                        "labels": {"namespace": "sandbox-lanes", "pod": "pod-a"},
                    }
                ],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(port)
    try:

        async def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}"
                )
            try:
                async with prom._session.get(f"{prom.base}/-/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await prom.until("prometheus ready", ready, timeout_s=60)
        yield prom
    finally:
        await prom.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# --- the pod, its workload, the scenarios ----------------------------------------------------------------


def completed(execution_id: str) -> inputs_pb2.PhaseChanged:
    return inputs_pb2.PhaseChanged(
        meta=new_meta(),
        kind=common_pb2.WORKFLOW_EXECUTION,
        execution_id=execution_id,
        previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
        new_phase=common_pb2.EXECUTION_COMPLETED,
    )


@pytest.mark.kafka
async def test_every_alert_fires_in_its_scenario_and_every_panel_returns_series(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokafka.errors import KafkaError

    from consumers.runtime.kafka.sink import TransactionalSink

    env = unique_env(
        kafka_bootstrap,
        tmp_path,
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_REAP_GRACE_S="0",
        SANDBOX_LANES_MAX_SANDBOXES="3",  # the capacity ledger on: its panels and its alert
    )
    settings = load_settings(env)
    topics = settings.topics
    expected_alerts = set(alert_rules())
    assert expected_alerts == {
        "SandboxLanesDeadLetters",
        "SandboxLanesLeakedSandboxes",
        "SandboxLanesConsumerLag",
        "SandboxLanesCommitFailures",
        "SandboxLanesCapacityFull",
    }, "a new shipped alert needs its scenario here"
    provisioner = MemoryProvisioner()
    async with running_pod(env, provisioner=provisioner) as composed:
        # The agent-sandbox driver's warm-pool families (its WarmPoolMetrics, bound to the pod's
        # registry as the driver binds it) need the agent-sandbox controller to move for real; here
        # the same class records a warm and a cold launch and a miss, so that the dashboard's warm-pool
        # queries are run against the families and labels the driver really exports.
        warm = WarmPoolMetrics(composed.metrics.registry)
        warm.pool_ready.set(2)
        warm.time_to_sandbox.labels("warm").observe(0.12)
        warm.time_to_sandbox.labels("cold").observe(4.0)
        warm.misses.labels("not ready in time").inc()

        ops = OpsServer(composed.pod, composed.metrics, host="127.0.0.1", port=0, stall_after_s=30.0)
        await ops.start()
        try:
            await wait_for_status(ops.port, "/readyz", 200)
            async with prometheus(tmp_path, ops.port) as prom:

                async def scraped(expr: str, at_least: float) -> None:
                    """Prometheus has scraped a value of ``expr`` >= ``at_least``, then evaluated the rules."""

                    async def seen() -> bool:
                        result = await prom.query(expr)
                        return bool(result) and float(result[0]["value"][1]) >= at_least

                    await prom.until(f"{expr} >= {at_least}", seen)
                    await prom.rules_evaluated_after(time.time())

                async def firing(names: set[str]) -> None:
                    async def exactly() -> bool:
                        active = await prom.active_alerts()
                        return active == {n: "firing" for n in names}

                    try:
                        await prom.until(f"firing = {sorted(names)}", exactly, timeout_s=30)
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}; active: {await prom.active_alerts()}") from None

                # 1. A healthy run: lanes provision and tear down, nothing fails. No alert is active,
                #    and every alert expression, run as a query, returns nothing.
                #    (Three sandboxes, the cap: each is provisioned before its end is produced, so
                #    none ends while it still waits for its admission.)
                await produce(
                    kafka_bootstrap,
                    env,
                    wf_created("wfx_dash_1"),
                    wf_created("wfx_dash_2"),
                    agent_created("axr_dash_1", "ses_dash_1"),
                )
                await read_topic(kafka_bootstrap, topics.outcomes, at_least=3)
                await produce(
                    kafka_bootstrap,
                    env,
                    completed("wfx_dash_1"),
                    inputs_pb2.SessionDeleted(meta=new_meta(), session_id="ses_dash_1"),
                )
                await read_topic(kafka_bootstrap, topics.outcomes, at_least=5)
                await scraped("sum(sandbox_lanes_outputs_total)", 5)
                assert await prom.active_alerts() == {}
                for name, rule in alert_rules().items():
                    assert await prom.query(rule["expr"]) == [], name

                # 2. A dead letter (a record that cannot be decoded).
                await produce_raw(kafka_bootstrap, topics.execution_created, b"garbage", b"wfx_bad", [])
                await scraped('sandbox_lanes_dead_letters_total{reason="undecodable"}', 1)
                await firing({"SandboxLanesDeadLetters"})

                # 3. A leaked sandbox: the driver's teardown fails (the pod's first leak: its
                #    driver-labelled series appears at 1).
                provisioner.teardown_failure_rate = 1.0
                await produce(kafka_bootstrap, env, completed("wfx_dash_2"))
                await scraped("sum(sandbox_lanes_leaked_sandboxes_total)", 1)
                await firing({"SandboxLanesDeadLetters", "SandboxLanesLeakedSandboxes"})

                # The reaper then removes the leaked sandbox (its execution is terminal).
                provisioner.teardown_failure_rate = 0.0
                reaper = reaper_for(settings, composed)
                assert reaper is not None
                report = await reaper.run_once(apply=True)
                assert [r.removed for r in report.results] == [True], report
                await scraped("sum(sandbox_lanes_reaped_sandboxes_total)", 1)

                # 3b. The cap (3) held with a create waiting: three sandboxes run, a fourth waits
                #     (SandboxQueued tells upstream).
                await produce(kafka_bootstrap, env, *(wf_created(f"wfx_full_{i}") for i in range(4)))
                await scraped("max(sandbox_lanes_capacity_live_sandboxes)", 3)
                await scraped("sum(sandbox_lanes_capacity_waiting)", 1)
                await firing(
                    {"SandboxLanesDeadLetters", "SandboxLanesLeakedSandboxes", "SandboxLanesCapacityFull"}
                )

                # 4. A stuck partition: the broker refuses every commit (injected at the commit
                #    call; each transaction is real and aborted for real) while 1,100 records arrive.
                #    Nothing is committed: the lag grows past the alert's 1,000 and commits keep failing.
                real_commit = TransactionalSink.commit

                async def refused(self: TransactionalSink, offsets: Any) -> None:
                    raise KafkaError("injected: the broker refused the commit")

                monkeypatch.setattr(TransactionalSink, "commit", refused)
                await produce(kafka_bootstrap, env, *(wf_created(f"wfx_lag_{i}") for i in range(1100)))
                await scraped(f'sum(sandbox_lanes_consumer_lag{{topic="{topics.execution_created}"}})', 1001)
                await firing(expected_alerts)
                monkeypatch.setattr(TransactionalSink, "commit", real_commit)

                # 5. Every dashboard query returns series.
                empty = [(title, expr) for title, expr in dashboard_queries() if not await prom.query(expr)]
                assert empty == [], empty
        finally:
            await ops.stop()
