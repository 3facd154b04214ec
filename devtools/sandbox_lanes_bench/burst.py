"""``sandbox-lanes bench --only burst``: time to sandbox for a burst of workflow creates.

N CLOUD workflow ``ExecutionCreated`` are produced at once to an in-process pod (exactly_once);
then N terminal phase changes. Measured from the outside: the time until the N-th
``SandboxProvisioned`` (then ``SandboxDeprovisioned``) is readable with read_committed, and each
execution's produce → committed-outcome time (p50/p99). Two drivers:

* ``memory`` with an injected latency (``--burst-latency-ms``, default 200 ms per call): the
  goal is ≥ 0.8 x concurrency / latency ensures/s (the pool kept full);
* ``docker`` on a private engine, next to the raw engine limit in the same run: the same N
  containers created and started straight through the Docker SDK at the same concurrency;
* ``kubernetes`` on a single-node cluster (``--burst-k8s-n``, default 50; ``bench.kube_burst``):
  the kubernetes driver returns once its objects are applied, so the time to sandbox there is
  measured to the runner pod's Running, next to a docker burst of the same N in the same run.

The pod's longest transaction (``max_transaction_s``) is reported too: no driver call is inside
one, so it stays short however long the calls take.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import created_event, lane_env, memory_provisioner, pct, running_pod
from sandbox_lanes_bench.drivers import docker_engine

logger = logging.getLogger("sandbox_lanes.bench")

#: Memory driver burst: ensures/s ≥ this share of concurrency / latency.
POOL_SHARE_GOAL = 0.8
#: Docker burst ≤ this x the raw engine time for the same containers.
DOCKER_RATIO_GOAL = 1.3
#: No transaction longer than this, seconds.
MAX_TRANSACTION_GOAL_S = 2.0


AfterProvision = Callable[[list[str], dict[str, float]], Awaitable[None]]


async def _pod_burst(
    env: dict[str, str],
    provisioner: Any,
    n: int,
    show: bool,
    label: str,
    timeout_s: float,
    after_provision: AfterProvision | None = None,
    one_at_a_time: bool = False,
    before_each: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """One burst of N creates then N terminal changes through a running pod (``one_at_a_time``:
    each create sent once the previous one's outcome is committed, the uncontended latency).

    ``after_provision(ids, sent)`` runs between the two, with each create's send time
    (``time.monotonic``): a driver that returns before its sandbox runs measures that there.
    """
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from consumers.ops.settings import load_settings
    from events.codec import OUTCOME_TYPES, decode, encode, new_meta
    from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2

    settings = load_settings(env)
    topics = settings.topics
    ids = [f"wfx_burst_{uuid.uuid4().hex[:6]}_{i}" for i in range(n)]
    sent: dict[str, float] = {}
    seen: dict[type, dict[str, float]] = {
        outcomes_pb2.SandboxProvisioned: {},
        outcomes_pb2.SandboxDeprovisioned: {},
    }
    failures = (outcomes_pb2.SandboxFailed, outcomes_pb2.SandboxTeardownFailed)
    failed: list[str] = []
    consumer = AIOKafkaConsumer(
        topics.outcomes,
        bootstrap_servers=settings.bootstrap,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=5)
    async with running_pod(env, provisioner=provisioner) as pod:
        await consumer.start()
        await producer.start()

        async def phase(kind: type, make: Callable[[str], Any], topic: str) -> tuple[float, list[float]]:
            mine = seen[kind]
            sent.clear()
            started = time.monotonic()
            deadline = time.monotonic() + timeout_s

            async def send(execution_id: str) -> None:
                rec = encode(make(execution_id))
                sent[execution_id] = time.monotonic()
                await producer.send(topic, rec.value, key=rec.key, headers=rec.headers)
                await producer.flush()

            async def collect(bar: Any, until: int) -> None:
                while len(mine) < until:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{label}: {len(mine)}/{n} {kind.__name__} in {timeout_s:.0f}s")
                    batches = await consumer.getmany(timeout_ms=20 if one_at_a_time else 200)
                    now = time.monotonic()
                    for records in batches.values():
                        for rec in records:
                            message: Any = decode(rec.key, rec.value, rec.headers, allowed=OUTCOME_TYPES)
                            outcome_of: str = message.execution_id
                            if type(message) is kind and outcome_of not in mine:
                                mine[outcome_of] = now
                                bar.advance()
                            elif isinstance(message, failures):
                                failed.append(f"{outcome_of}: {message.reason}")
                                if len(failed) >= 5:
                                    raise RuntimeError(f"{label}: driver calls failed: {failed}")

            with progress(f"{label}: {kind.__name__}", n, enabled=show) as bar:
                if one_at_a_time:
                    for i, execution_id in enumerate(ids):
                        if before_each is not None and kind is outcomes_pb2.SandboxProvisioned:
                            await before_each()
                        await send(execution_id)
                        await collect(bar, i + 1)
                else:
                    for execution_id in ids:
                        rec = encode(make(execution_id))
                        sent[execution_id] = time.monotonic()
                        await producer.send(topic, rec.value, key=rec.key, headers=rec.headers)
                    await producer.flush()
                    await collect(bar, n)
            total = max(mine.values()) - started
            return total, [(mine[e] - sent[e]) * 1000 for e in ids]

        def terminal(execution_id: str) -> Any:
            return inputs_pb2.PhaseChanged(
                meta=new_meta(),
                kind=common_pb2.WORKFLOW_EXECUTION,
                execution_id=execution_id,
                previous_phase=common_pb2.EXECUTION_IN_PROGRESS,
                new_phase=common_pb2.EXECUTION_COMPLETED,
            )

        try:
            up_s, up_ms = await phase(
                outcomes_pb2.SandboxProvisioned, created_event, topics.execution_created
            )
            if after_provision is not None:
                await after_provision(ids, dict(sent))
            down_s, down_ms = await phase(outcomes_pb2.SandboxDeprovisioned, terminal, topics.phase_changed)
        finally:
            await producer.stop()
            await consumer.stop()
    return {
        "n": n,
        "concurrency": pod.config.driver_concurrency,
        "provision_seconds": up_s,
        "ensures_per_s": n / up_s,
        "time_to_sandbox_p50_ms": pct(up_ms, 50),
        "time_to_sandbox_p99_ms": pct(up_ms, 99),
        # per create, ms: event sent -> its SandboxProvisioned read (the plots' distributions)
        "samples_ms": {"provisioned": up_ms},
        "teardown_seconds": down_s,
        "teardowns_per_s": n / down_s,
        "teardown_p50_ms": pct(down_ms, 50),
        "teardown_p99_ms": pct(down_ms, 99),
        "max_transaction_s": pod.stats.max_transaction_s,
        "commit_failures": pod.stats.commit_failures,
    }


def _raw_docker(host: str, image: str, n: int, concurrency: int, show: bool) -> dict[str, float]:
    """The engine's own limit: N containers created and started, then removed, at the same concurrency."""
    import docker

    from drivers.docker import CONTAINER_USER, CONTAINER_WORKDIR, RUNNER_COMMAND, RUNNER_ENTRYPOINT

    client = docker.DockerClient(base_url=host, max_pool_size=concurrency)
    tag = uuid.uuid4().hex[:6]
    names = [f"raw-burst-{tag}-{i}" for i in range(n)]

    def create(name: str) -> None:
        container = client.containers.create(
            image,
            name=name,
            labels={"bench": tag},
            user=CONTAINER_USER,
            working_dir=CONTAINER_WORKDIR,
            detach=True,
            mem_limit="64m",
            nano_cpus=500_000_000,
            security_opt=["no-new-privileges"],
            cap_drop=["ALL"],
            network_mode="none",
            entrypoint=[RUNNER_ENTRYPOINT],
            command=[RUNNER_COMMAND],
        )
        container.start()

    def remove(name: str) -> None:
        client.containers.get(name).remove(force=True)

    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            started = time.monotonic()
            with progress("raw engine: create + start", n, enabled=show) as bar:
                for future in concurrent.futures.as_completed([pool.submit(create, m) for m in names]):
                    future.result()
                    bar.advance()
            up = time.monotonic() - started
            started = time.monotonic()
            for future in concurrent.futures.as_completed([pool.submit(remove, m) for m in names]):
                future.result()
            down = time.monotonic() - started
    finally:
        for container in client.containers.list(all=True, filters={"label": f"bench={tag}"}):
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                logger.warning("raw burst container left", extra={"container": container.name})
        client.close()
    return {"create_start_seconds": up, "remove_seconds": down}


class _Skipped(Exception):
    """A burst of 0 creates asked for: not run, no row."""


async def measure_burst(args: Any, bootstrap: str, show: bool) -> dict[str, Any]:
    """Both bursts; a driver that cannot run reports its error in its row."""
    out: dict[str, Any] = {}
    concurrency = str(args.burst_concurrency)

    def env(tag: str) -> dict[str, str]:
        return {
            **lane_env(bootstrap, tag, 3, "exactly_once"),
            "SANDBOX_LANES_DRIVER_CONCURRENCY": concurrency,
            "SANDBOX_LANES_CREATE_TOPICS": "true",
        }

    latency = float(args.burst_latency_ms)
    try:
        if args.burst_n <= 0:
            raise _Skipped
        memory = memory_provisioner(ensure_latency_ms=latency, teardown_latency_ms=latency)
        result = await _pod_burst(
            env(f"burst-mem-{uuid.uuid4().hex[:6]}"), memory, args.burst_n, show, "memory burst", 600
        )
        result["latency_ms"] = latency
        result["pool_bound_per_s"] = args.burst_concurrency / (latency / 1000)
        out["memory"] = result
    except _Skipped:
        pass
    except Exception as exc:
        logger.error("memory burst failed", extra={"error": str(exc)})
        out["memory"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        if args.burst_docker_n <= 0:
            raise _Skipped
        out["docker"] = await _docker_burst(
            args, env(f"burst-dk-{uuid.uuid4().hex[:6]}"), show, args.burst_docker_n
        )
    except _Skipped:
        pass
    except Exception as exc:
        logger.error("docker burst failed", extra={"error": str(exc)})
        out["docker"] = {"error": f"{type(exc).__name__}: {exc}"}
    if args.burst_k8s_n > 0:
        from sandbox_lanes_bench.kube_burst import kubernetes_burst

        try:
            k8s = await kubernetes_burst(
                args,
                lambda tag: env(f"burst-{tag}-{uuid.uuid4().hex[:6]}"),
                show,
                args.burst_k8s_n,
                _pod_burst,
            )
            if "running_p50_ms" in k8s:  # the kubernetes driver's burst ran: docker beside it
                k8s["docker_same_n"] = await _docker_burst(
                    args, env(f"burst-dk-{uuid.uuid4().hex[:6]}"), show, args.burst_k8s_n
                )
            out["kubernetes"] = k8s
        except Exception as exc:
            logger.error("kubernetes burst failed", extra={"error": str(exc)})
            out["kubernetes"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


async def _docker_burst(args: Any, env: dict[str, str], show: bool, n: int) -> dict[str, Any]:
    from drivers.contract import DriverConfig
    from drivers.docker import new_docker_provisioner

    loop = asyncio.get_running_loop()
    async with docker_engine(args) as (host, image, _private):
        config = DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            options={
                "docker_host": host,
                "image": image,
                "memory": "64m",
                "cpus": "0.5",
                "network": "none",  # the bench's engine has no bridge; the raw baseline matches
                "hardened": "true",
                "max_pool_size": str(args.burst_concurrency),
            },
        )
        provisioner = new_docker_provisioner(config, logger)
        try:
            result = await _pod_burst(env, provisioner, n, show, f"docker burst of {n}", 900)
        finally:
            await provisioner.close()
        raw = await loop.run_in_executor(None, _raw_docker, host, image, n, args.burst_concurrency, show)
    result["raw_create_start_seconds"] = raw["create_start_seconds"]
    result["raw_remove_seconds"] = raw["remove_seconds"]
    result["ratio_to_raw"] = result["provision_seconds"] / raw["create_start_seconds"]
    result["teardown_ratio_to_raw"] = result["teardown_seconds"] / raw["remove_seconds"]
    return result


def report_rows(fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows (figure, value, detail, goal) for the bench's markdown table."""
    rows: list[tuple[str, str, str, str]] = []
    mem = fig.get("memory", {})
    if "error" in mem:
        rows.append(("7. burst, memory driver", "error", mem["error"][:120], ""))
    elif mem:
        goal = POOL_SHARE_GOAL * mem["pool_bound_per_s"]
        ok = mem["ensures_per_s"] >= goal
        rows += [
            (
                f"7. burst of {mem['n']:,} creates, memory driver at {mem['latency_ms']:.0f} ms/call, "
                f"concurrency {mem['concurrency']}: ensures/s",
                f"{mem['ensures_per_s']:,.0f}",
                f"all provisioned in {mem['provision_seconds']:.1f} s",
                f"≥ {goal:,.0f} {'met' if ok else 'MISSED'}",
            ),
            (
                "   time to sandbox p50 / p99, ms",
                f"{mem['time_to_sandbox_p50_ms']:,.0f} / {mem['time_to_sandbox_p99_ms']:,.0f}",
                "",
                "",
            ),
            (
                "   teardowns/s; teardown p50 / p99, ms",
                f"{mem['teardowns_per_s']:,.0f}",
                f"{mem['teardown_p50_ms']:,.0f} / {mem['teardown_p99_ms']:,.0f}",
                "",
            ),
            _transaction_row(mem),
        ]
    dk = fig.get("docker", {})
    if "error" in dk:
        rows.append(("   burst, docker driver", "error", dk["error"][:120], ""))
    elif dk:
        ok = dk["ratio_to_raw"] <= DOCKER_RATIO_GOAL
        rows += [
            (
                f"   burst of {dk['n']:,} creates, docker driver: seconds (raw engine, same run)",
                f"{dk['provision_seconds']:.1f}",
                f"raw {dk['raw_create_start_seconds']:.1f} s, ratio {dk['ratio_to_raw']:.2f}",
                f"≤ {DOCKER_RATIO_GOAL}x {'met' if ok else 'MISSED'}",
            ),
            (
                "   docker time to sandbox p50 / p99, ms",
                f"{dk['time_to_sandbox_p50_ms']:,.0f} / {dk['time_to_sandbox_p99_ms']:,.0f}",
                "",
                "",
            ),
            (
                "   docker teardown: seconds (raw engine)",
                f"{dk['teardown_seconds']:.1f}",
                f"raw {dk['raw_remove_seconds']:.1f} s, ratio {dk['teardown_ratio_to_raw']:.2f}",
                "",
            ),
            _transaction_row(dk),
        ]
    rows += _kubernetes_rows(fig.get("kubernetes", {}))
    return rows


#: agent-sandbox warm, one create at a time on a full pool: event in -> the runner holds its secrets.
WARM_HELD_P50_GOAL_MS = 150.0
WARM_HELD_P99_GOAL_MS = 300.0
#: A burst as large as the pool: every runner holds its secrets within this of its event (p99).
WARM_BURST_HELD_P99_GOAL_MS = 500.0


def _kubernetes_rows(k8s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    if "error" in k8s:
        return [("   burst, kubernetes driver", "error", k8s["error"][:120], "")]
    if not k8s:
        return []
    dk = k8s.get("docker_same_n", {})
    docker = (
        f"docker, same {dk['n']} in this run: {dk['time_to_sandbox_p50_ms']:,.0f} / "
        f"{dk['time_to_sandbox_p99_ms']:,.0f}"
        if dk and "error" not in dk
        else "docker: " + str(dk.get("error", "not measured"))[:80]
    )
    rows = (
        []
        if "running_p50_ms" not in k8s
        else [
            (
                f"   burst of {k8s['n']:,} creates, kubernetes driver ({k8s['cluster']}): "
                "create -> runner pod Running p50 / p99, ms",
                f"{k8s['running_p50_ms']:,.0f} / {k8s['running_p99_ms']:,.0f}",
                docker,
                "",
            ),
            (
                "   kubernetes: create -> SandboxProvisioned committed p50 / p99, ms; all Running, s",
                f"{k8s['time_to_sandbox_p50_ms']:,.0f} / {k8s['time_to_sandbox_p99_ms']:,.0f}",
                f"all {k8s['n']} Running after {k8s['all_running_seconds']:.1f} s",
                "",
            ),
            _transaction_row(k8s),
            *_cold_rows("kubernetes", k8s),
        ]
    )
    if "agent_sandbox_error" in k8s:
        rows.append(("   burst, agent-sandbox driver", "error", k8s["agent_sandbox_error"][:120], ""))
    cold = k8s.get("agent_sandbox_cold")
    if cold:
        rows.append(
            (
                "   agent-sandbox cold (a Sandbox each): create -> runner pod Running p50 / p99, ms",
                f"{cold['running_p50_ms']:,.0f} / {cold['running_p99_ms']:,.0f}",
                f"SandboxProvisioned p50 / p99 {cold['time_to_sandbox_p50_ms']:,.0f} / "
                f"{cold['time_to_sandbox_p99_ms']:,.0f} ms",
                "",
            )
        )
        rows += _cold_rows("agent-sandbox cold", cold)
    warm = k8s.get("agent_sandbox_warm")
    if warm:
        rows += _warm_rows(warm)
    return rows


def _warm_rows(warm: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    from sandbox_lanes_bench.launch_steps import WARM_STEPS

    one, burst = warm.get("sequential_steps") or {}, warm.get("burst_steps") or {}
    rows: list[tuple[str, str, str, str]] = []
    if one:
        ok = (
            one["whole"] > 0
            and one["secrets_held_p50_ms"] < WARM_HELD_P50_GOAL_MS
            and one["secrets_held_p99_ms"] < WARM_HELD_P99_GOAL_MS
        )
        rows += [
            (
                f"   agent-sandbox warm, {warm['sequential_n']} creates one at a time on a full pool "
                f"(warm_assignment={warm['assignment']}): event in -> runner holds its secrets p50 / p99, ms",
                f"{one['secrets_held_p50_ms']:,.0f} / {one['secrets_held_p99_ms']:,.0f}",
                f"{one['whole']} of {one['creates']} timed whole; SandboxProvisioned p50 / p99 "
                f"{warm['sequential_p50_ms']:,.0f} / {warm['sequential_p99_ms']:,.0f}; "
                f"handovers (both runs) {warm.get('handovers', {})}",
                f"< {WARM_HELD_P50_GOAL_MS:.0f} / {WARM_HELD_P99_GOAL_MS:.0f} {'met' if ok else 'MISSED'}",
            ),
            (
                "   event in -> runner started (its first log line) p50 / p99, ms",
                f"{one['runner_started_p50_ms']:,.0f} / {one['runner_started_p99_ms']:,.0f}",
                "",
                "",
            ),
        ]
        rows += step_rows(one, WARM_STEPS)
    if burst:
        ok = burst["whole"] == warm["n"] and burst["secrets_held_p99_ms"] < WARM_BURST_HELD_P99_GOAL_MS
        rows.append(
            (
                f"   agent-sandbox warm, burst of {warm['n']} on a pool of {warm['n']}: "
                "event in -> runner holds its secrets p50 / p99, ms",
                f"{burst['secrets_held_p50_ms']:,.0f} / {burst['secrets_held_p99_ms']:,.0f}",
                f"{burst['whole']} of {burst['creates']} timed whole; launches {warm['launches']}, "
                f"{warm['adoption_misses']} misses; runner started p50 / p99 "
                f"{burst['runner_started_p50_ms']:,.0f} / {burst['runner_started_p99_ms']:,.0f}",
                f"p99 < {WARM_BURST_HELD_P99_GOAL_MS:.0f} {'met' if ok else 'MISSED'}",
            )
        )
    rows += [
        (
            "   warm burst: SandboxProvisioned committed p50 / p99, ms",
            f"{warm['time_to_sandbox_p50_ms']:,.0f} / {warm['time_to_sandbox_p99_ms']:,.0f}",
            "",
            "",
        ),
        (
            "   warm pool: fill from 0, s; refill after the burst, s (sandboxes/s)",
            f"{warm['pool_fill_seconds']:.1f}",
            f"{warm['pool_refill_seconds']:.1f} ({warm['pool_refill_per_s']:.1f}/s)",
            "",
        ),
        _transaction_row(warm),
    ]
    return rows


def step_rows(found: dict[str, Any], steps: tuple[tuple[str, str], ...]) -> list[tuple[str, str, str, str]]:
    """A row per step of a launch's breakdown (``launch_steps.breakdown``): p50 / p99 from the step before."""
    return [
        (
            f"     step {name}: p50 / p99, ms",
            f"{found['steps_p50_ms'][name]:,.1f} / {found['steps_p99_ms'][name]:,.1f}",
            what,
            "",
        )
        for name, what in steps
        if name in found.get("steps_p50_ms", {})
    ]


def _cold_rows(label: str, fig: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    from sandbox_lanes_bench.launch_steps import COLD_STEPS, COLD_STEPS_API

    found = fig.get("steps") or {}
    if not found:
        return []
    steps = COLD_STEPS if found.get("steps") == [name for name, _ in COLD_STEPS] else COLD_STEPS_API
    return [
        (
            f"   {label}, burst of {fig['n']}: event in -> runner started p50 / p99, ms, step by step",
            f"{found['runner_started_p50_ms']:,.0f} / {found['runner_started_p99_ms']:,.0f}",
            f"{found['whole']} of {found['creates']} timed whole"
            + (f"; unseen steps {found['missing']}" if found.get("missing") else ""),
            "",
        ),
        *step_rows(found, steps),
    ]


def _transaction_row(fig: dict[str, Any]) -> tuple[str, str, str, str]:
    ok = fig["max_transaction_s"] <= MAX_TRANSACTION_GOAL_S
    return (
        "   longest transaction, s",
        f"{fig['max_transaction_s']:.3f}",
        f"{fig['commit_failures']} commit failures",
        f"≤ {MAX_TRANSACTION_GOAL_S:g} {'met' if ok else 'MISSED'}",
    )
