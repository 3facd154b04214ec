"""Network faults on real parts (issue 42, deliverable 5): Toxiproxy between the pods and each broker of
the harness's three-node cluster (``proxied_kafka``: one proxy per node, each node advertising its proxy
on a listener of its own, so every connection of the pods goes through a proxy; the cluster's own links
and the test's clients stay direct). Two ``sandbox-lanes run`` processes under ``exactly_once``, a
steady stream of executions, and one fault at a time, each in a run of its own (fresh topics and group):

* ``latency``: 500 ms each way on every link;
* ``blackhole``: the group coordinator's node black-holed (Toxiproxy ``timeout`` 0: bytes dropped,
  connections held) for twice the transaction timeout;
* ``resets``: every connection reset (TCP RST, ``reset_peer``) 1 s after it opens, on every link;
* ``bandwidth``: 10 KB/s each way on every link;
* ``outage``: the whole cluster unreachable (every proxy disabled: connections refused, open ones
  closed) for 40 s, long enough for the backoff (0.1 s doubling, capped at 5 s) to reach its cap;
  the ten-minute outage is the same scenario at 600 s, collected only with
  ``NETWORK_FAULTS_LONG_OUTAGE=1`` (not in CI; its figures are in docs/guarantees.md).

In each, a third into the fault one pod is sent SIGTERM: it must exit 0 within its shutdown bound while
the fault holds; it is started again when the fault ends.

Verdicts, all measured, none by a sleep:

* every execution's outcomes exactly once: the chaos oracle (tests/support/chaos_verify.py) on what
  the topics hold, plus duplicates and losses counted;
* every input consumed within 60 s after the fault ends: the group's committed offsets at the input
  topics' end offsets (the feed stops 3 s after the fault ends), every driver call folded back;
* no pod exits by itself; SIGTERM honoured during the fault and at the end (exit 0);
* at most one ERROR line per episode in the pods' structured logs: per pod process, ERROR lines
  counted by message and partition (an episode logs its first failure at ERROR, reminders at WARNING).

Printed per scenario: recovery (fault end to offsets committed; to the last outcome readable), ERROR
and WARNING lines by message, the pods' longest loop stall, duplicates, losses, wall time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaClient

from consumers.ops.settings import load_settings
from consumers.tools.embedded_broker import free_port
from tests.support.broker_faults import OrderedFeed, OutcomeWatch, Pods, exactly_once_figures, thread_dump
from tests.support.chaos_verify import group_lag, read_all, verify, wait_caught_up, wait_effects_folded
from tests.support.chaos_workload import LANE_ENV, generate
from tests.support.fixtures.toxiproxy import ProxiedKafka
from tests.support.pod_harness import unique_env

pytestmark = [pytest.mark.kafka, pytest.mark.usefixtures("no_leftover_pods")]

EXECUTIONS_PER_S = 3.0
PARTITIONS = 4
#: The product's default transaction timeout (docs/configuration.md): the black hole lasts twice it.
TRANSACTION_TIMEOUT_S = 15.0
STALL_SECONDS = 30.0
SHUTDOWN_TIMEOUT_S = 10.0
#: Interpreter exit and the last log lines around the pod's own bound.
SIGTERM_MARGIN_S = 5.0
#: Every input must be consumed this long after the fault ends at the latest.
RECOVERY_BOUND_S = 60.0
#: The stream runs this long before the fault and this long after it ends (schedule, not verdicts).
WARMUP_S = 5.0
TAIL_S = 3.0
#: An outage cuts the pods off: past their transaction timeout, no transaction of theirs commits.
CUT_OFF_AFTER_S = TRANSACTION_TIMEOUT_S + 5
#: The ten-minute outage: only with this variable set to 1 (never in CI).
LONG_OUTAGE_ENV = "NETWORK_FAULTS_LONG_OUTAGE"  # not SANDBOX_LANES_*: the pod refuses unknown settings


@dataclass(frozen=True)
class Fault:
    name: str
    seconds: float
    what: str

    def apply(self, proxied: ProxiedKafka, group: str) -> str:
        """Put the fault in place; returns what exactly was done."""
        if self.name == "latency":
            proxied.add_toxic("latency", {"latency": 500, "jitter": 0})
            return "500 ms latency each way on all 3 proxies"
        if self.name == "blackhole":
            node = proxied.cluster.group_coordinator(group)
            proxied.add_toxic("timeout", {"timeout": 0}, nodes=[node])
            return f"node {node} (the group's coordinator) black-holed"
        if self.name == "resets":
            proxied.add_toxic("reset_peer", {"timeout": 1000})
            return "every connection reset 1 s after it opens, all 3 proxies"
        if self.name == "bandwidth":
            proxied.add_toxic("bandwidth", {"rate": 10})
            return "10 KB/s each way on all 3 proxies"
        if self.name == "outage":
            proxied.set_enabled(False)
            return "all 3 proxies disabled"
        raise ValueError(self.name)


FAULTS = [
    Fault("latency", 20.0, "500 ms latency on every link"),
    Fault("blackhole", 2 * TRANSACTION_TIMEOUT_S, "one broker black-holed for twice the transaction timeout"),
    Fault("resets", 20.0, "connection resets"),
    Fault("bandwidth", 20.0, "10 KB/s bandwidth"),
    Fault("outage", 40.0, "the whole cluster unreachable (backoff reaches its 5 s cap)"),
]
if os.environ.get(LONG_OUTAGE_ENV) == "1":
    FAULTS.append(Fault("outage", 600.0, "the whole cluster unreachable for 10 minutes"))


async def _sigterm(pods: Pods, name: str, bound_s: float) -> tuple[int | None, float]:
    """SIGTERM one pod (taken out of ``pods`` first: its exit is planned) and wait up to ``bound_s``;
    one still running is dumped (py-spy) and killed. Returns (exit code or None, seconds)."""
    pod = pods.procs.pop(name)
    for watch in pods.health[name]:
        watch.stop()
    assert pod.proc is not None
    began = time.monotonic()
    pod.proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(pod.proc.wait, bound_s)
        return code, time.monotonic() - began
    except subprocess.TimeoutExpired:
        out = pods.logs / f"{name}-sigterm-in-fault.py-spy.txt"
        where = await asyncio.to_thread(thread_dump, pod.proc.pid, out)
        pods.dumps.append(f"{name} (still running {bound_s:g}s after SIGTERM in the fault): {where}")
        pod.proc.kill()
        await asyncio.to_thread(pod.proc.wait, 10)
        return None, time.monotonic() - began


@dataclass
class LogLine:
    file: str
    logger: str
    at: float
    level: str
    msg: str
    partition: str
    error: str


def _from_client(line: LogLine) -> bool:
    """A line of a Kafka client library the pod logs through (not one of the pod's own episodes)."""
    return line.logger.startswith("aiokafka") or line.logger == "sandbox_lanes.librdkafka"


def _log_lines(logs: Path, levels: set[str]) -> tuple[list[LogLine], int]:
    """The pods' structured log lines at ``levels``, and how many lines were not JSON (a traceback
    printed outside the log, say)."""
    found: list[LogLine] = []
    unstructured = 0
    for path in sorted(logs.glob("pod-*.log")):
        for raw in path.read_text(errors="replace").splitlines():
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                unstructured += 1
                continue
            if not isinstance(line, dict) or line.get("level") not in levels:
                continue
            at = dt.datetime.fromisoformat(str(line.get("ts"))).timestamp()
            found.append(
                LogLine(
                    path.name,
                    str(line.get("logger", "")),
                    at,
                    str(line["level"]),
                    str(line.get("msg", "")),
                    # One partition's line says "partition"; the forget log's (a fence, say) "partitions".
                    str(line.get("partition", line.get("partitions", ""))),
                    str(line.get("error", ""))[:160],
                )
            )
    return found, unstructured


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.name}-{f.seconds:g}s")
async def test_a_network_fault_loses_nothing_duplicates_nothing_and_is_ridden_out(
    fault: Fault,
    proxied_kafka: ProxiedKafka,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    began = time.monotonic()
    caplog.set_level(logging.CRITICAL, logger="aiokafka")
    cluster = proxied_kafka.cluster
    direct = proxied_kafka.direct_bootstrap
    await asyncio.to_thread(cluster.wait_isr_full, 120.0)
    run_s = WARMUP_S + fault.seconds + TAIL_S
    workload_full = generate(
        int(EXECUTIONS_PER_S * (run_s + 30)),
        42,
        rate_per_s=EXECUTIONS_PER_S,
        early_share=0.0,  # as in the broker-fault test: every input valid, one history's order kept
        session_delete_share=0.0,
        retry_share=0.0,
        base=dt.datetime.now(dt.UTC).replace(microsecond=0),
    )
    env = unique_env(
        proxied_kafka.bootstrap,  # the pods reach every broker through its proxy
        tmp_path,
        SANDBOX_LANES_PROCESSING_GUARANTEE="exactly_once",
        SANDBOX_LANES_PARTITIONS=str(PARTITIONS),
        SANDBOX_LANES_SESSION_TIMEOUT_MS="10000",
        SANDBOX_LANES_TRANSACTION_TIMEOUT_MS=str(int(TRANSACTION_TIMEOUT_S * 1000)),
        SANDBOX_LANES_HTTP_HOST="127.0.0.1",
        SANDBOX_LANES_STALL_SECONDS=f"{STALL_SECONDS:g}",
        SANDBOX_LANES_SHUTDOWN_TIMEOUT_S=f"{SHUTDOWN_TIMEOUT_S:g}",
        SANDBOX_LANES_REAP_INTERVAL_S="0",
        SANDBOX_PROVISIONER_TYPE="memory",
        SANDBOX_LANES_DRIVER_OPTIONS="latency_jitter_ms=300,seed=42",
        **LANE_ENV,
    )
    settings = load_settings(env)
    topics = settings.topics
    group = settings.group_id
    names = ["pod-a", "pod-b"]
    pods = Pods(env, tmp_path, {name: free_port() for name in names})
    for name in names:
        pods.start(name)
    await pods.until_ready(names, 90)

    watch = OutcomeWatch(direct, topics.outcomes)
    watch_task = asyncio.create_task(watch.run())
    feed = OrderedFeed(direct, env, workload_full.plan)  # the feed is not faulted: load goes on
    feed_task = asyncio.create_task(feed.run())

    async def keep_checking() -> None:  # a pod that exits by itself is recorded and started again
        while True:
            pods.check()
            await asyncio.sleep(1.0)

    checking = asyncio.create_task(keep_checking())
    bound = SHUTDOWN_TIMEOUT_S + SIGTERM_MARGIN_S
    try:
        await asyncio.sleep(WARMUP_S)  # schedule: the stream runs before the fault
        fault_at = time.monotonic()
        fault_wall = time.time()
        done = await asyncio.to_thread(fault.apply, proxied_kafka, group)
        await asyncio.sleep(fault.seconds / 3)
        in_fault = await _sigterm(pods, "pod-b", bound)
        sigterm_at = fault.seconds / 3
        await asyncio.sleep(max(0.0, fault.seconds - (time.monotonic() - fault_at)))
        lasted_s = time.monotonic() - fault_at  # the scheduled length, or longer if the SIGTERM wait was
        await asyncio.to_thread(proxied_kafka.heal)
        healed_at = time.monotonic()
        healed_wall = time.time()
        pods.start("pod-b")  # a fresh process, as its Deployment would start it
        await asyncio.sleep(TAIL_S)
    finally:
        feed.stop()
        checking.cancel()
        await asyncio.to_thread(proxied_kafka.heal)
    await feed_task
    left = max(1.0, RECOVERY_BOUND_S - (time.monotonic() - healed_at))
    lag = await wait_caught_up(direct, group, list(topics.inputs), left, pods.check)
    consumed_s = time.monotonic() - healed_at
    unfolded = await wait_effects_folded(direct, topics.state, 60.0, pods.check)
    folded_s = time.monotonic() - healed_at
    exits = await pods.terminate(bound)
    watch.stop()
    await watch_task
    lag_after = await group_lag(direct, group, list(topics.inputs))

    workload = feed.workload(workload_full)
    all_ids = {p.event.meta.event_id for p in workload.plan}
    verdict, _states, expected = await verify(
        direct, topics, workload, guarantee="exactly_once", all_event_ids=all_ids, driver="memory"
    )
    outcomes, dead_letters = await asyncio.gather(
        read_all(direct, topics.outcomes), read_all(direct, topics.dead_letter)
    )
    counted = exactly_once_figures(outcomes, dead_letters, expected)
    awaited = set(expected.provision) | set(expected.teardown)
    first_seen: dict[str, float] = {}
    for at, cause in watch.seen:
        first_seen.setdefault(cause, at)
    last_outcome_s = max((first_seen[c] for c in awaited if c in first_seen), default=healed_at) - healed_at

    lines_seen, unstructured = _log_lines(tmp_path, {"error", "warning", "critical"})
    errors = [ln for ln in lines_seen if ln.level in ("error", "critical")]
    warnings = [ln for ln in lines_seen if ln.level == "warning"]
    per_episode = Counter((ln.file, ln.msg, ln.partition) for ln in errors if not _from_client(ln))
    repeated = {k: n for k, n in per_episode.items() if n > 1}
    per_client_message = Counter((ln.file, ln.msg) for ln in errors if _from_client(ln))
    repeated_clients = {k: n for k, n in per_client_message.items() if n > 1}

    checks: list[tuple[str, bool, str]] = list(verdict.lines)
    checks.append(
        (
            "exactly once: no duplicate, no loss",
            counted.duplicates == 0 and counted.losses == 0,
            "; ".join(counted.details[:12]),
        )
    )
    checks.append(
        (
            f"every input consumed within {RECOVERY_BOUND_S:g}s after the fault ended",
            lag == 0 and consumed_s <= RECOVERY_BOUND_S,
            f"{lag} input records not committed {consumed_s:.1f}s after; {lag_after} after SIGTERM",
        )
    )
    checks.append(("every driver call folded back", unfolded == 0, f"{unfolded} states still pending"))
    checks.append(("no pod exited by itself", not pods.unplanned, "; ".join(pods.unplanned[:3])))
    checks.append(
        (
            f"pod-b: SIGTERM during the fault honoured (exit 0 within {bound:g}s)",
            in_fault[0] == 0 and in_fault[1] <= bound,
            f"exit {'none: killed' if in_fault[0] is None else in_fault[0]} after {in_fault[1]:.1f}s",
        )
    )
    if fault.name == "outage":  # the proxies are the pods' only way in: nothing new may come out
        cut_from = fault_at + CUT_OFF_AFTER_S
        during = [at for at, _ in watch.seen if cut_from < at < healed_at]
        checks.append(
            (
                f"the pods were cut off: no outcome readable from {CUT_OFF_AFTER_S:g}s into the outage to its end",
                not during,
                f"{len(during)} outcomes readable meanwhile",
            )
        )
    for name, (code, took) in exits.items():
        checks.append(
            (
                f"{name}: SIGTERM at the end honoured (exit 0 within {bound:g}s)",
                code == 0 and took <= bound,
                f"exit {'none: killed' if code is None else code} after {took:.1f}s",
            )
        )
    checks.append(
        (
            "the pod's own loggers: at most one ERROR line per episode (per process, message, partition)",
            not repeated,
            "; ".join(f"{n}x {f} {m!r} partition={p or '-'}" for (f, m, p), n in repeated.items()),
        )
    )
    checks.append(
        (
            "the Kafka clients' lines in the pod's log (aiokafka, librdkafka): no ERROR message twice",
            not repeated_clients,
            f"{sum(repeated_clients.values())} lines of {len(repeated_clients)} repeated messages, e.g. "
            + "; ".join(f"{n}x {f} {m!r}" for (f, m), n in Counter(repeated_clients).most_common(4)),
        )
    )

    def by_message(found: list[LogLine]) -> str:
        counts = Counter((ln.msg, ln.partition) for ln in found)
        return "; ".join(f"{n}x {m!r}" + (f" p{p}" if p else "") for (m, p), n in counts.most_common(12))

    def rel(ln: LogLine) -> str:
        if ln.at < fault_wall:
            return f"{ln.at - fault_wall:+.1f}s before the fault"
        if ln.at <= healed_wall:
            return f"{ln.at - fault_wall:.1f}s into the fault"
        return f"{ln.at - healed_wall:.1f}s after it ended"

    wall_s = time.monotonic() - began
    figures = {
        "fault": f"{fault.name} {fault.seconds:g}s",
        "executions": feed.executions,
        "input records": len(workload.plan),
        "consumed after the fault s": round(consumed_s, 1),
        "last outcome after the fault s": round(last_outcome_s, 1),
        "folded after the fault s": round(folded_s, 1),
        "ERROR lines": len(errors),
        "WARNING lines": len(warnings),
        "duplicates": counted.duplicates,
        "losses": counted.losses,
        "wall time s": round(wall_s, 1),
    }
    report = [
        "network fault: " + ", ".join(f"{k}={v}" for k, v in figures.items()),
        f"  {done}, from {fault_at - feed.started_at:.1f}s into the feed for {lasted_s:.1f}s ({fault.what})",
        f"  pod-b SIGTERM {sigterm_at:.1f}s into the fault: exit {in_fault[0]} in {in_fault[1]:.1f}s; "
        f"feed resends {feed.resends}; outcomes seen {len(watch.seen)}; {unstructured} non-JSON log lines",
        f"  ERROR by message: {by_message(errors) or 'none'}",
        f"  WARNING by message: {by_message(warnings) or 'none'}",
    ]
    own = [ln for ln in errors if not _from_client(ln)]
    clients = [ln for ln in errors if _from_client(ln)]
    report.append(f"  ERROR lines: {len(own)} of the pod's own loggers, {len(clients)} of the Kafka clients")
    shown = own[:16] + clients[:6]
    report += [
        f"    {ln.file} ERROR {rel(ln)}: [{ln.logger}] {ln.msg} p={ln.partition or '-'} {ln.error}"
        for ln in shown
    ]
    for name in names:
        report.append(
            f"  {name}: longest loop stall {pods.longest_stall(name):.1f}s "
            f"({pods.longest_since_turned(name):.1f}s since a turn, declared broker waits included), "
            f"SIGTERM at the end -> exit {exits[name][0]} in {exits[name][1]:.1f}s"
        )
    report += [
        f"  {'PASS' if ok else 'FAIL'}  {name}" + (f" ({detail})" if detail else "")
        for name, ok, detail in checks
    ]
    report += [f"    - {v}" for v in verdict.violations[:12]]
    report += [f"  thread dump: {d}" for d in pods.dumps]
    report.append(f"  logs: {tmp_path}")
    text = "\n".join(report)
    with capsys.disabled():
        print("\n" + text)
    failed = [name for name, ok, _ in checks if not ok]
    assert not failed, text


async def test_every_broker_is_reached_through_its_own_proxy(proxied_kafka: ProxiedKafka) -> None:
    """The harness under the faults: bootstrapped on the proxies, a client is told each broker's proxy
    (so no connection bypasses one), the direct listener still names the direct ports, and a disabled
    proxy refuses connections while its broker serves on."""
    cluster = proxied_kafka.cluster

    async def advertised(bootstrap: str) -> dict[int, int]:
        client = AIOKafkaClient(bootstrap_servers=bootstrap)
        await client.bootstrap()
        try:
            return {b.nodeId: b.port for b in client.cluster.brokers()}
        finally:
            await client.close()

    assert await advertised(proxied_kafka.bootstrap) == {n.node_id: n.proxy_port for n in cluster.nodes}
    assert await advertised(proxied_kafka.direct_bootstrap) == {n.node_id: n.port for n in cluster.nodes}
    node = cluster.nodes[0]
    proxied_kafka.set_enabled(False, nodes=[0])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", node.proxy_port), timeout=5).close()
    socket.create_connection(("127.0.0.1", node.port), timeout=5).close()
