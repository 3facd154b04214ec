"""The pod's operations endpoints (aiohttp, on the pod's own event loop).

* ``GET /metrics``: the pod's :class:`~consumers.runtime.metrics.PodMetrics` registry in the Prometheus text
  format. Before each scrape the consumer-lag gauge is refreshed from the consumer's current
  assignment (high watermark - position), so an idle pod reports its real lag and a revoked
  partition's series disappears.
* ``GET /healthz``: liveness. 200 while the consume loop turned within
  ``SANDBOX_LANES_STALL_SECONDS``, else 503; failing commits never fail it (a broker outage or a
  missing ACL would restart every pod). Body: :class:`~consumers.runtime.pod_config.Health` as JSON.
* ``GET /readyz``: readiness. 200 when alive, commits not failing for the stall window, and the state
  of every assigned partition restored, or, with no partition assigned, the group joined (an idle
  member is ready); 503 (with the reason in ``detail``) while starting, restoring, failing or stalled.

Each scrape also sets ``sandbox_lanes_ready``, ``sandbox_lanes_assigned_partitions`` and
``sandbox_lanes_commits_failing_seconds`` from the same assessment.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from consumers.runtime.kafka.clients import group_joined
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.pod import Pod
from consumers.runtime.pod_config import Health, with_membership

logger = logging.getLogger("sandbox_lanes.http")

_POSITION_TIMEOUT_S = 0.5


class OpsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` for one pod; ``port=0`` binds an ephemeral port."""

    def __init__(
        self,
        pod: Pod,
        metrics: PodMetrics | None = None,
        *,
        host: str = "0.0.0.0",
        port: int = 8080,
        stall_after_s: float = 30.0,
    ) -> None:
        self.pod = pod
        self.metrics = metrics or pod.metrics
        self.host = host
        self.port = port
        self.stall_after_s = stall_after_s
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/healthz", self.handle_healthz)
        app.router.add_get("/readyz", self.handle_readyz)
        app.router.add_get("/", self.handle_index)
        return app

    async def start(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = runner.addresses[0] if runner.addresses else (self.host, self.port)
        self.port = int(bound[1])
        logger.info("http server listening", extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- handlers ----------------------------------------------------------------------------

    def health(self) -> Health:
        """The pod's health, knowing the group membership (an idle member is ready)."""
        health = self.pod.health(self.stall_after_s)
        return with_membership(health, group_joined(self.pod.consumer), self.stall_after_s)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        await self.refresh_lag()
        health = self.health()
        self.metrics.ready.set(1 if health.ready else 0)
        self.metrics.assigned_partitions.set(health.assigned_partitions)
        self.metrics.commits_failing.set(health.commits_failing_seconds)
        # generate_latest (the text format) unless the scraper asks for OpenMetrics.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.metrics.registry), headers={"Content-Type": content_type})

    async def handle_healthz(self, request: web.Request) -> web.Response:
        health = self.health()
        return web.json_response(dataclasses.asdict(health), status=200 if health.alive else 503)

    async def handle_readyz(self, request: web.Request) -> web.Response:
        health = self.health()
        return web.json_response(dataclasses.asdict(health), status=200 if health.ready else 503)

    async def handle_index(self, request: web.Request) -> web.Response:
        return web.Response(text="sandbox-lanes: /metrics /healthz /readyz\n")

    # --- lag ---------------------------------------------------------------------------------

    async def refresh_lag(self) -> None:
        """Lag per assigned partition = high watermark - next offset to process; stale series removed.

        Skipped while a batch is in flight: the consumer's position is then ahead of what is
        committed, and the pod sets the gauge itself when the batch commits.
        """
        consumer: Any = self.pod.consumer
        if consumer is None or self.pod.turn_in_progress:
            return
        gauge = self.metrics.consumer_lag
        assigned: set[tuple[str, str]] = set()
        for tp in list(consumer.assignment()):
            labels = (tp.topic, str(tp.partition))
            assigned.add(labels)
            highwater = consumer.highwater(tp)
            if highwater is None:
                continue
            with contextlib.suppress(Exception):
                position = await asyncio.wait_for(consumer.position(tp), _POSITION_TIMEOUT_S)
                gauge.labels(*labels).set(max(0, highwater - position))
        for metric in gauge.collect():
            for sample in metric.samples:
                labels = (sample.labels["topic"], sample.labels["partition"])
                if labels not in assigned:
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels)
