"""Chaos run: the pod on a real Kafka broker under kill -9, a broker restart, rebalances, duplicated and
reordered input and failing drivers; then a verifier checks every invariant against what the pure
rules say the inputs must produce.

    python -m tests.support.chaos --help
    python -m tests.support.chaos                                  # 2000 executions, memory driver, both guarantees
    python -m tests.support.chaos --driver local-process --executions 200

The broker is a real Apache Kafka (devtools/harness/kafka_broker.py) the script starts and stops itself,
unless ``--bootstrap`` names one (then it is not restarted). Pods are ``sandbox-lanes run`` child
processes (tests/pod_harness.PodProcess). Exit code 0 = ``ALL-RECORDS-DELIVERED``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aiokafka import AIOKafkaProducer
from harness.kafka_broker import KafkaBroker, prepare

from consumers.ops.progress import progress
from consumers.ops.settings import load_settings
from consumers.tools.topic_io import topic_for
from drivers.contract import ManagedSandbox
from drivers.local_process import new_local_process_provisioner
from events.codec import encode
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2
from tests.support.chaos_verify import Verdict, _sample, read_all, verify, wait_caught_up, wait_effects_folded
from tests.support.chaos_workload import LANE_ENV, Workload, generate
from tests.support.pod_harness import ROOT, PodProcess, unique_env
from tests.support.proc_util import processes_under

Driver = Literal["memory", "local-process"]
logger = logging.getLogger("sandbox_lanes.chaos")


@dataclass
class ChaosOptions:
    executions: int = 2000
    kills: int = 5
    driver: Driver = "memory"
    seed: int = 1
    guarantees: tuple[str, ...] = ("exactly_once", "at_least_once")
    bootstrap: str | None = None
    broker_restarts: int = 1
    rebalance_windows: int = 1
    ensure_failure_rate: float = 0.05
    teardown_failure_rate: float = 0.05
    #: Memory driver: each call takes 0..latency_ms (a real engine's time), and this share hangs
    #: until the pod's ensure/teardown timeout (5 s in a run with hangs) ends it.
    latency_ms: float = 0.0
    hang_rate: float = 0.0
    feed_seconds: float | None = None
    partitions: int = 3
    settle_timeout_s: float = 300.0
    #: The pods' state store (``SANDBOX_LANES_STATE_STORE``); ``rocksdb``: each pod id keeps its own
    #: state directory across its restarts (a StatefulSet's volume), so a restart reads its tail.
    state_store: str = "memory"
    work_dir: Path | None = None
    report: Path | None = None
    show_progress: bool | None = None
    out: Callable[[str], None] = print


@dataclass
class RunResult:
    guarantee: str
    verdict: Verdict
    figures: dict[str, float | int | str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict.ok


class Fleet:
    """The pod instances of one deployment (one consumer group), as child processes."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.a: PodProcess | None = None
        self.b: PodProcess | None = None
        self.starts = 0
        self.kills = 0
        self.unplanned: list[str] = []
        self.startup_failures = 0
        self.rebalances = 0

    def _new(self, pod_id: str) -> PodProcess:
        self.starts += 1
        env = {**self.env, "SANDBOX_LANES_POD_ID": pod_id}
        if env.get("SANDBOX_LANES_STATE_STORE") == "rocksdb":
            env["SANDBOX_LANES_STATE_DIR"] = str(self.logs / f"state-{pod_id}")
        pod = PodProcess(env, self.logs / f"{pod_id}-{self.starts}.log")
        pod.start()
        return pod

    def start_a(self) -> None:
        self.a = self._new("pod-a")  # same pod id after a restart (a StatefulSet): it fences its predecessor

    def kill_a(self) -> None:
        if self.a is not None and self.a.proc is not None and self.a.proc.poll() is None:
            self.a.kill9()
            self.kills += 1
        self.a = None  # down until start_a: not an unplanned exit

    def start_b(self) -> None:
        self.b = self._new("pod-b")
        self.rebalances += 1

    def stop_b(self) -> None:
        pod, self.b = self.b, None  # leaving on purpose: not an unplanned exit
        if pod is not None and pod.proc is not None and pod.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.terminate(45)
            self.rebalances += 1

    def check(self) -> None:
        """A pod that exited without being told to is a violation; bring it back (bounded)."""
        for name in ("a", "b"):
            pod: PodProcess | None = getattr(self, name)
            if pod is None or pod.proc is None or pod.proc.poll() is None:
                continue
            log = pod.log()
            if "pod started" not in log and pod.proc.returncode != 0:
                # Could not reach the broker at start-up (it is restarting): the restart policy's job.
                self.startup_failures += 1
                if self.startup_failures > 30:
                    raise RuntimeError("pods keep failing to start:\n" + log[-3000:])
            else:
                tail = log[-1500:].replace("\n", " | ")
                self.unplanned.append(f"pod-{name} exited by itself with {pod.proc.returncode}: {tail}")
            if len(self.unplanned) > 10:
                raise RuntimeError("pods keep exiting by themselves:\n" + "\n".join(self.unplanned))
            if name == "a":
                self.start_a()
            else:
                self.b = None

    def stop_all(self) -> None:
        for pod in (self.b, self.a):
            if pod is not None and pod.proc is not None and pod.proc.poll() is None:
                try:
                    pod.terminate(45)
                except subprocess.TimeoutExpired:
                    pod.proc.kill()
                    pod.proc.wait(10)
        self.a = self.b = None


# --- feeding --------------------------------------------------------------------------------------


async def _send(producer: AIOKafkaProducer, topic: str, record: object, attempts: int = 60) -> int:
    """send_and_wait with bounded retries (the broker may be restarting); returns the resends."""
    from events.codec import EncodedRecord

    assert isinstance(record, EncodedRecord)
    for attempt in range(attempts):
        try:
            await producer.send_and_wait(topic, record.value, key=record.key, headers=record.headers)
            return attempt
        except Exception:
            await asyncio.sleep(0.5)
    raise RuntimeError(f"could not produce to {topic} after {attempts} attempts")


async def feed(
    bootstrap: str,
    env: dict[str, str],
    workload: Workload,
    speed: float,
    tick: Callable[[], None],
    show_progress: bool | None,
) -> int:
    topics = load_settings(env).topics
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=2,
        request_timeout_ms=15000,
    )
    await producer.start()
    resends = 0
    try:
        started = time.monotonic()
        plan = workload.plan
        i = 0
        with progress("chaos feed", total=len(plan), enabled=show_progress) as bar:
            while i < len(plan):
                now = (time.monotonic() - started) * speed
                due: list[tuple[str, object]] = []
                while i < len(plan) and plan[i].at <= now:
                    event = plan[i].event
                    due.append((topic_for(event, topics), encode(event, source="chaos-feeder")))
                    i += 1
                if due:
                    futures = []
                    for topic, rec in due:
                        futures.append(
                            await producer.send(topic, rec.value, key=rec.key, headers=rec.headers)  # type: ignore[attr-defined]
                        )
                    results = await asyncio.gather(*futures, return_exceptions=True)
                    for (topic, rec), res in zip(due, results, strict=True):
                        if isinstance(res, BaseException):
                            resends += 1 + await _send(producer, topic, rec)
                    bar.advance(len(due))
                tick()
                await asyncio.sleep(0.02)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), 30)
    return resends


# --- one run --------------------------------------------------------------------------------------


def _driver_env(opts: ChaosOptions, work: Path, workload: Workload, rng: random.Random) -> dict[str, str]:
    if opts.driver == "memory":
        env = {
            "SANDBOX_PROVISIONER_TYPE": "memory",
            "SANDBOX_LANES_DRIVER_OPTIONS": (
                f"ensure_failure_rate={opts.ensure_failure_rate},teardown_failure_rate={opts.teardown_failure_rate},"
                f"latency_jitter_ms={opts.latency_ms},hang_rate={opts.hang_rate},seed={rng.randrange(1 << 30)}"
            ),
        }
        if opts.hang_rate:
            env["SANDBOX_LANES_ENSURE_TIMEOUT_S"] = env["SANDBOX_LANES_TEARDOWN_TIMEOUT_S"] = "5"
        return env
    # local-process: real runner processes. Ensure failures: the workspace path of a share of
    # sandboxes is a plain file (mkdir fails). Teardown failures: a share of runners ignore SIGTERM
    # for longer than the teardown timeout (a real leak until the reaper's SIGKILL).
    state_dir = work / "sandboxes"
    state_dir.mkdir(parents=True, exist_ok=True)
    sandboxes: list[tuple[str, str]] = [("session", s) for s in workload.sessions]
    for item in workload.plan:
        ev = item.event
        if isinstance(ev, inputs_pb2.ExecutionCreated) and ev.kind == common_pb2.WORKFLOW_EXECUTION:
            sandboxes.append(("workflow", ev.execution_id))
    stubborn: list[str] = []
    for scope, sandbox_id in sorted(set(sandboxes)):
        roll = rng.random()
        if roll < opts.ensure_failure_rate:
            (state_dir / f"{scope}-{sandbox_id}").write_text("not a directory: injected ensure failure\n")
        elif roll < opts.ensure_failure_rate + opts.teardown_failure_rate:
            stubborn.append(("session:" if scope == "session" else "wfexec:") + sandbox_id)
    stubborn_file = work / "stubborn-queues.txt"
    stubborn_file.write_text("".join(q + "\n" for q in stubborn))
    return {
        "SANDBOX_PROVISIONER_TYPE": "local-process",
        "STIGMER_SANDBOX_RUNNER_COMMAND": f"{shlex.quote(sys.executable)} -m tests.support.chaos_runner",
        "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={state_dir},grace_seconds=3",
        "SANDBOX_LANES_TEARDOWN_TIMEOUT_S": "1.5",
        "CHAOS_STUBBORN_FILE": str(stubborn_file),
        "CHAOS_RUNNER_MAX_S": "900",
    }


def _schedule(
    opts: ChaosOptions, feed_s: float, rng: random.Random, can_restart_broker: bool
) -> list[tuple[float, str]]:
    actions: list[tuple[float, str]] = [(rng.uniform(0.05, 1.0) * feed_s, "kill") for _ in range(opts.kills)]
    if can_restart_broker:
        actions += [(rng.uniform(0.3, 0.7) * feed_s, "broker-restart") for _ in range(opts.broker_restarts)]
    for w in range(opts.rebalance_windows):
        begin = (0.1 + 0.5 * w / max(1, opts.rebalance_windows)) * feed_s
        actions += [(begin, "pod-b-join"), (begin + max(8.0, 0.3 * feed_s), "pod-b-leave")]
    return sorted(actions)


async def _local_process_leaks(
    env: dict[str, str], work: Path, terminal: set[str], deleted: set[str], out: Callable[[str], None]
) -> tuple[list[str], dict[str, int]]:
    """Run the reaper (or, while it does not exist, reap directly), then check list_managed and /proc."""
    figures: dict[str, int] = {}
    settings = load_settings(env)
    driver = new_local_process_provisioner(settings.driver, logging.getLogger("sandbox_lanes.chaos.driver"))

    def over(scope: str, sandbox_id: str) -> bool:
        return (scope == "workflow" and sandbox_id in terminal) or (
            scope == "session" and sandbox_id in deleted
        )

    before = [m for m in await driver.list_managed() if over(m.scope, m.sandbox_id)]
    figures["leaked before the reaper"] = len(before)
    if importlib.util.find_spec("consumers.tools.reaper") is not None:
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "consumers.tools.cli", "reap", "--apply"],
            # The operator's reaper runs with the default teardown bound, not the pods' short one.
            env={**os.environ, **env, "PYTHONPATH": str(ROOT), "SANDBOX_LANES_TEARDOWN_TIMEOUT_S": "60"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        out(f"  reaper: `sandbox-lanes reap --apply` exited {proc.returncode}")
        problems = reaper_problems(proc.returncode, proc.stdout, before, figures)
        if proc.returncode != 0:
            out("  " + (proc.stdout + proc.stderr)[-2000:].replace("\n", "\n  "))
    else:
        problems = ["consumers/tools/reaper.py not present: nothing reaped"]
    after = [m for m in await driver.list_managed() if over(m.scope, m.sandbox_id)]
    problems += [
        f"workflow {m.sandbox_id} still managed and running after the reaper"
        for m in after
        if m.scope == "workflow"
    ]
    # A create processed after its session's deletion (another partition) provisions it again: the
    # reaper keeps that one by its rule, so it is a figure, not a violation.
    figures["deleted sessions alive again after the reaper"] = sum(1 for m in after if m.scope == "session")
    # What the kernel says: no runner process for a terminal workflow or a deleted session.
    for pid in processes_under(work):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        queue = next(
            (v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"STIGMER_TASK_QUEUE=")), ""
        )
        scope, _, sandbox_id = queue.partition(":")
        if scope == "wfexec" and sandbox_id in terminal:
            problems.append(f"pid {pid} ({queue}) alive in /proc for a terminal workflow")
    figures["live runners at the end (non-terminal)"] = len(await driver.list_managed())
    # Clean up: nothing of this run outlives it.
    for m in await driver.list_managed():
        with contextlib.suppress(Exception):
            await driver.deprovision(m.scope, m.sandbox_id)
    for pid in processes_under(work):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    await driver.close()
    return problems, figures


_REAP_SUMMARY = re.compile(r"(\d+) to reap, (\d+) removed, (\d+) failed")


def reaper_problems(
    returncode: int, stdout: str, leaked: list[ManagedSandbox], figures: dict[str, int]
) -> list[str]:
    """The reaper's own account: it must exit 0, fail nothing, and remove something when terminal
    workflows' runners were left behind (a reaper that does nothing must not pass)."""
    problems = [] if returncode == 0 else [f"`sandbox-lanes reap --apply` exited {returncode}"]
    summary = _REAP_SUMMARY.search(stdout)
    if summary is None:
        return [*problems, f"the reaper printed no summary: {stdout[-300:]!r}"]
    candidates, removed, failed = (int(g) for g in summary.groups())
    figures["reaper candidates"], figures["reaper removed"] = candidates, removed
    if failed:
        problems.append(f"the reaper failed {failed} removals")
    leaked_workflows = sum(1 for m in leaked if m.scope == "workflow")
    if leaked_workflows and removed == 0:
        problems.append(f"{leaked_workflows} terminal workflows' runners leaked, the reaper removed none")
    return problems


_IGNORED = re.compile(r'"duplicate input ignored".*?"eventId": "([^"]+)"')


def duplicates_ignored(work: Path, workload: Workload, guarantee: str) -> tuple[list[str], dict[str, int]]:
    """The pods' "duplicate input ignored" log lines against the injected duplicates.

    Every injected duplicate (same event id, after its original was applied) must be ignored, so the
    count is never zero; under exactly_once a state and its input offset commit together, so no
    other input may be ignored as a duplicate (non-zero is a violation); under at_least_once an input
    redelivered after a kill is (its state was written before the offset), and is counted.
    """
    injected = {p.event.meta.event_id for p in workload.plan if p.why == "duplicate"}
    ignored: set[str] = set()
    for log in work.glob("pod-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "duplicate input ignored" in line:
                match = _IGNORED.search(line)
                ignored.add(match.group(1) if match else line[-200:])
    problems = [f"injected duplicate {e} was not ignored" for e in sorted(injected - ignored)]
    if not injected:
        problems.append("no duplicate injected: the duplicate filter went unexercised")
    redelivered = ignored - injected
    if guarantee == "exactly_once":
        problems += [f"input {e} ignored as a duplicate, never injected twice" for e in sorted(redelivered)]
    return problems, {
        "injected duplicates ignored": len(injected & ignored),
        "inputs redelivered after a kill and ignored": len(redelivered),
    }


async def one_run(
    opts: ChaosOptions, guarantee: str, bootstrap: str, broker: KafkaBroker | None, work: Path
) -> RunResult:
    out = opts.out
    began = time.monotonic()
    rng = random.Random(f"{opts.seed}/{guarantee}")
    feed_s = opts.feed_seconds or max(20.0, opts.executions / 60.0)
    rate = opts.executions / feed_s
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    workload = generate(opts.executions, opts.seed, rate_per_s=rate, base=now)
    work.mkdir(parents=True, exist_ok=True)
    env = unique_env(
        bootstrap,
        work,
        SANDBOX_LANES_PROCESSING_GUARANTEE=guarantee,
        SANDBOX_LANES_PARTITIONS=str(opts.partitions),
        SANDBOX_LANES_HTTP_PORT="0",  # no HTTP server: pods share the host
        SANDBOX_LANES_REAP_INTERVAL_S="0",  # the reaper runs once, at the end, where it is checked
        SANDBOX_LANES_STATE_STORE=opts.state_store,
        **LANE_ENV,
        **_driver_env(opts, work, workload, rng),
    )
    settings = load_settings(env)
    topics = settings.topics
    all_ids = {p.event.meta.event_id for p in workload.all_records()}
    out(
        f"[{guarantee}] {opts.executions} executions, {workload.counts['events']} records, driver {opts.driver}, "
        f"state store {opts.state_store}, group {settings.group_id}, logs in {work}"
    )
    fleet = Fleet(env, work)
    broker_restarts = 0
    fleet.start_a()
    try:
        assert fleet.a is not None
        await fleet.a.wait_for_log("pod started", 90)
        # A reorder WITHIN histories: phase events before their create (dead letters by design).
        if workload.early:
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
            await producer.start()
            try:
                for item in workload.early:
                    await _send(
                        producer, topic_for(item.event, topics), encode(item.event, source="chaos-feeder")
                    )
            finally:
                await producer.stop()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if len(await read_all(bootstrap, topics.dead_letter)) >= len(workload.early):
                    break
                fleet.check()
                await asyncio.sleep(0.5)
        actions = _schedule(opts, feed_s, rng, broker is not None)
        feeding_started = time.monotonic()

        async def chaos() -> None:
            nonlocal broker_restarts
            for at, action in actions:
                delay = feeding_started + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                fleet.check()
                if action == "kill":
                    fleet.kill_a()
                    await asyncio.sleep(rng.uniform(0.0, 1.5))
                    fleet.start_a()
                    fleet.rebalances += 1
                elif action == "broker-restart" and broker is not None:
                    await asyncio.to_thread(broker.restart)
                    broker_restarts += 1
                elif action == "pod-b-join":
                    fleet.start_b()
                elif action == "pod-b-leave":
                    await asyncio.to_thread(fleet.stop_b)

        chaos_task = asyncio.create_task(chaos())
        resends = await feed(bootstrap, env, workload, 1.0, fleet.check, opts.show_progress)
        await chaos_task
        fleet.stop_b()
        lag = await wait_caught_up(
            bootstrap, settings.group_id, list(topics.inputs), opts.settle_timeout_s, fleet.check
        )
        unfolded = await wait_effects_folded(bootstrap, topics.state, opts.settle_timeout_s, fleet.check)
    finally:
        fleet.stop_all()
    verdict, _states, expected = await verify(
        bootstrap, topics, workload, guarantee=guarantee, all_event_ids=all_ids, driver=opts.driver
    )
    problems, ignored_figures = duplicates_ignored(work, workload, guarantee)
    verdict.check(
        "duplicates: every injected same-id input ignored once applied"
        + (", and no other (exactly_once)" if guarantee == "exactly_once" else ""),
        _sample(problems),
    )
    verdict.figures.update(ignored_figures)
    verdict.check("pod never stopped by itself", fleet.unplanned[:5])
    verdict.check(
        "the group consumed every input", [] if lag == 0 else [f"{lag} input records not committed"]
    )
    verdict.check(
        "every driver call folded back",
        [] if unfolded == 0 else [f"{unfolded} execution states still hold pending driver calls"],
    )
    if opts.driver == "local-process":
        problems, figures = await _local_process_leaks(
            env, work, expected.terminal_workflows, expected.deleted_sessions, out
        )
        verdict.check(
            "no sandbox alive for a terminal execution once the reaper ran (list_managed + /proc)", problems
        )
        verdict.figures.update(figures)
    else:
        verdict.lines.append(
            (
                "no sandbox alive for a terminal execution: the memory driver dies with its pod; checked on state",
                True,
                "",
            )
        )
    figures: dict[str, float | int | str] = {
        "guarantee": guarantee,
        "driver": opts.driver,
        "executions": opts.executions,
        "events": workload.counts["events"],
        "kills": fleet.kills,
        "broker restarts": broker_restarts,
        "rebalances": fleet.rebalances,
        "duplicates injected": workload.counts["duplicates"],
        "create retries (new id) injected": workload.counts["retries"],
        "reordered across executions": workload.counts["reordered"],
        "reordered within a history (expected dead letters)": workload.counts["early"],
        "session deletions": workload.counts["session_deletes"],
        "recovers": workload.counts["recovers"],
        "stale": workload.counts["stale"],
        "equal timestamps": workload.counts["equal timestamps"],
        "feeder resends": resends,
        "pod start-ups refused while the broker was down (restarted)": fleet.startup_failures,
        **verdict.figures,
        "violations": len(verdict.violations),
        "elapsed s": round(time.monotonic() - began, 1),
    }
    return RunResult(guarantee, verdict, figures)


def print_result(result: RunResult, out: Callable[[str], None]) -> None:
    for name, ok, detail in result.verdict.lines:
        out(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f" ({detail})" if detail else ""))
    out("  figures: " + ", ".join(f"{k}={v}" for k, v in result.figures.items()))
    if result.ok:
        out(f"  [{result.guarantee}] ALL-RECORDS-DELIVERED")
    else:
        out(f"  [{result.guarantee}] VIOLATIONS ({len(result.verdict.violations)}):")
        for v in result.verdict.violations[:60]:
            out(f"    - {v}")


async def run_chaos(opts: ChaosOptions) -> list[RunResult]:
    work = opts.work_dir or Path(tempfile.mkdtemp(prefix="sandbox-lanes-chaos-"))
    broker: KafkaBroker | None = None
    bootstrap = opts.bootstrap
    if bootstrap is None:
        await asyncio.to_thread(prepare)
        broker = KafkaBroker()
        await asyncio.to_thread(broker.start)
        bootstrap = broker.bootstrap
        opts.out(f"started Kafka on {bootstrap} in {broker.startup_seconds:.1f}s")
    elif opts.broker_restarts:
        opts.out("broker restart skipped: --bootstrap names a broker this script does not own")
    results: list[RunResult] = []
    try:
        for guarantee in opts.guarantees:
            result = await one_run(opts, guarantee, bootstrap, broker, work / guarantee)
            print_result(result, opts.out)
            results.append(result)
    finally:
        PodProcess.kill_all()
        if broker is not None:
            await asyncio.to_thread(broker.stop)
    if all(r.ok for r in results):
        opts.out("ALL-RECORDS-DELIVERED")
        if opts.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    else:
        opts.out(f"VIOLATIONS: see above; logs kept in {work}")
    if opts.report is not None:
        opts.report.write_text(
            json.dumps(
                [
                    {
                        "figures": r.figures,
                        "invariants": [{"name": n, "ok": ok, "detail": d} for n, ok, d in r.verdict.lines],
                        "violations": r.verdict.violations,
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--executions", type=int, default=2000, help="executions to feed (default 2000)")
    parser.add_argument(
        "--kills", type=int, default=5, help="kill -9 + restart the pod this many times (default 5)"
    )
    parser.add_argument("--driver", choices=["memory", "local-process"], default="memory")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--report", type=Path, help="write the figures and verdicts as JSON here")
    parser.add_argument(
        "--bootstrap", help="use this broker instead of starting one (no broker restart then)"
    )
    parser.add_argument(
        "--guarantee",
        choices=["exactly_once", "at_least_once", "both"],
        default="both",
        help="processing guarantee(s) to run under (default both, one after the other)",
    )
    parser.add_argument("--broker-restarts", type=int, default=1)
    parser.add_argument(
        "--rebalance-windows", type=int, default=1, help="windows with a second pod in the group"
    )
    parser.add_argument("--ensure-failure-rate", type=float, default=0.05)
    parser.add_argument("--teardown-failure-rate", type=float, default=0.05)
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="memory driver: calls take 0..this long"
    )
    parser.add_argument(
        "--hang-rate", type=float, default=0.0, help="memory driver: share of calls that hang"
    )
    parser.add_argument(
        "--feed-seconds", type=float, help="spread the feed over this long (default max(20, N/60))"
    )
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--settle-timeout", type=float, default=300.0)
    parser.add_argument("--work-dir", type=Path, help="keep pod logs and sandboxes here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the broker restart is on purpose
    opts = ChaosOptions(
        executions=args.executions,
        kills=args.kills,
        driver=args.driver,
        seed=args.seed,
        guarantees=("exactly_once", "at_least_once") if args.guarantee == "both" else (args.guarantee,),
        bootstrap=args.bootstrap,
        broker_restarts=args.broker_restarts,
        rebalance_windows=args.rebalance_windows,
        ensure_failure_rate=args.ensure_failure_rate,
        teardown_failure_rate=args.teardown_failure_rate,
        latency_ms=args.latency_ms,
        hang_rate=args.hang_rate,
        feed_seconds=args.feed_seconds,
        partitions=args.partitions,
        settle_timeout_s=args.settle_timeout,
        work_dir=args.work_dir,
        report=args.report,
        show_progress=False if args.no_progress else None,
    )
    results = asyncio.run(run_chaos(opts))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
