"""Figure 6: ensure / re-ensure / teardown latency of the local-process and docker drivers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from consumers.ops.progress import progress
from sandbox_lanes_bench.common import pct

logger = logging.getLogger("sandbox_lanes.bench")


# --- 6. drivers ---------------------------------------------------------------------------------


async def _driver_latency(
    provisioner: Any, samples: int, tag: str, repeats: int, show: bool, label: str
) -> dict[str, Any]:
    from drivers.contract import SandboxEnvironment

    ensure_ms: list[float] = []
    re_ensure_ms: list[float] = []
    teardown_ms: list[float] = []
    with progress(f"{label} ensure/re-ensure", samples * repeats, enabled=show) as bar:
        for r in range(repeats):
            ids = [f"{tag}-{r}-{i}" for i in range(samples)]
            try:
                for sid in ids:
                    env = SandboxEnvironment(task_queue=f"wfexec:{sid}", caller_class="user")
                    t = time.perf_counter()
                    await provisioner.ensure("workflow", sid, env)
                    ensure_ms.append((time.perf_counter() - t) * 1000)
                    state = await provisioner.probe("workflow", sid)
                    if state != "running":
                        raise RuntimeError(f"{label}: sandbox {sid} is {state} after ensure")
                    t = time.perf_counter()
                    await provisioner.ensure("workflow", sid, env)
                    re_ensure_ms.append((time.perf_counter() - t) * 1000)
                    bar.advance()
            finally:
                for sid in ids:
                    t = time.perf_counter()
                    with contextlib.suppress(Exception):
                        await provisioner.deprovision("workflow", sid)
                    teardown_ms.append((time.perf_counter() - t) * 1000)
    return {
        "samples": len(ensure_ms),
        "ensure_p50_ms": pct(ensure_ms, 50),
        "ensure_p99_ms": pct(ensure_ms, 99),
        "re_ensure_p50_ms": pct(re_ensure_ms, 50),
        "re_ensure_p99_ms": pct(re_ensure_ms, 99),
        "teardown_p50_ms": pct(teardown_ms, 50),
        "teardown_p99_ms": pct(teardown_ms, 99),
    }


async def _local_process(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    import shlex

    from drivers.contract import DriverConfig
    from drivers.local_process import new_local_process_provisioner

    state_dir = tempfile.mkdtemp(prefix="sl-bench-lp-")
    try:
        config = DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            runner_command=f"{shlex.quote(sys.executable)} -m consumers.tools.stub_runner",
            options={"state_dir": state_dir, "grace_seconds": "5"},
        )
        provisioner = new_local_process_provisioner(config, logger)
        try:
            return await _driver_latency(
                provisioner, args.driver_samples, "lp", args.repeats, show, "local-process"
            )
        finally:
            await provisioner.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def docker_engine(args: argparse.Namespace) -> AsyncIterator[tuple[str, str, bool]]:
    """``(host, image, private)``: ``--docker-host`` as given, or a private dockerd for the block."""
    if args.docker_host is not None and args.docker_image:
        yield args.docker_host, args.docker_image, False
        return
    from harness.dockerd import DEFAULT_TAG, Dockerd  # the dev harness: the same distribution as the bench

    loop = asyncio.get_running_loop()
    image = args.docker_image or DEFAULT_TAG
    if args.docker_host is not None:
        yield args.docker_host, image, False
        return
    engine = Dockerd()
    try:
        await loop.run_in_executor(None, engine.start)
        await loop.run_in_executor(None, engine.build_image, image)
    except BaseException:
        tail = engine.log_tail(10)
        await loop.run_in_executor(None, engine.stop)
        raise RuntimeError(f"private dockerd did not start: {tail[-600:]}") from None
    try:
        yield engine.socket_url, image, True
    finally:
        await loop.run_in_executor(None, engine.stop)


async def _docker(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from drivers.contract import DriverConfig
    from drivers.docker import new_docker_provisioner

    started = time.perf_counter()
    async with docker_engine(args) as (host, image, private):
        engine_s = time.perf_counter() - started
        config = DriverConfig(
            backend_endpoint="http://127.0.0.1:7234",
            temporal_address="127.0.0.1:7233",
            options={"docker_host": host, "image": image, "memory": "64m", "cpus": "0.5", "network": "none"},
        )
        provisioner = new_docker_provisioner(config, logger)
        try:
            result = await _driver_latency(
                provisioner, args.docker_samples, f"bx{uuid.uuid4().hex[:4]}", args.repeats, show, "docker"
            )
        finally:
            await provisioner.close()
        result["engine"] = "private dockerd (vfs)" if private else host
        result["engine_start_seconds"] = engine_s
        return result


async def measure_drivers(args: argparse.Namespace, show: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in (("local-process", _local_process), ("docker", _docker)):
        try:
            out[name] = await fn(args, show)
        except Exception as exc:
            logger.error("driver benchmark failed", extra={"driver": name, "error": str(exc)})
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
