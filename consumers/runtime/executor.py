"""The edge where decisions meet the world: mint the runner token, call the driver.

Every failure becomes a :class:`CommandResult` with the error's message; nothing
raises out of here, which is what keeps a provisioning failure from ever
crashing the pod. Timeouts bound a hung driver.

Engine quota is capacity: an ensure the engine refused as full (:class:`CapacityRefused`) is not a
failure yet. It is tried again with a :class:`Backoff`, woken early as this pod's sandboxes end
(:mod:`consumers.runtime.engine_quota`), without holding a driver-concurrency slot while it sleeps,
until ``admission_timeout_s`` has passed since the first refusal; then its result is the failure
``capacity: <the engine's words>`` (the lane's upstream failure path). One log line when the wait
begins, one when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from consumers.lanes.commands import Command, CommandResult, Ensure
from consumers.runtime.effects import call_current, slot_given_up
from consumers.runtime.engine_quota import EngineQuotaWaits
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.runner_tokens import RunnerCredentialProvider, mint_sandbox_token
from drivers.contract import CapacityRefused, SandboxEnvironment, SandboxProvisioner
from resilience.backoff import Backoff


def error_message(exc: BaseException) -> str:
    """For logs: the error's message, or its type when the message is empty."""
    text = str(exc)
    return text if text else type(exc).__name__


#: A driver error's text kept in results, states and outcomes at most (characters): an error
#: carrying a whole API response would otherwise make every record folded from it too large.
MAX_ERROR_CHARS = 16 * 1024


def upstream_message(exc: BaseException) -> str:
    """What upstream puts after the pre-stamp prefix: the error's message, even an empty one
    (cut to :data:`MAX_ERROR_CHARS`)."""
    text = str(exc)
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}… ({len(text) - MAX_ERROR_CHARS} characters cut)"


#: The prefix of the failure an engine quota wait ends in (as the capacity ledger's time-out).
CAPACITY_PREFIX = "capacity: "
#: A quota wait's backoff between attempts: 0.5 s, doubling, at most 10 s apart (a teardown wakes it
#: sooner).
QUOTA_FIRST_DELAY_S = 0.5
QUOTA_MAX_DELAY_S = 10.0


def capacity_error(refused: CapacityRefused) -> str:
    return CAPACITY_PREFIX + upstream_message(refused)


class CommandRunner:
    """Anything that turns a command into a result (the real executor, or replay's recorder)."""

    async def run(self, command: Command) -> CommandResult:
        raise NotImplementedError


@dataclass
class DriverExecutor(CommandRunner):
    provisioner: SandboxProvisioner
    credentials: RunnerCredentialProvider
    logger: logging.Logger
    ensure_timeout_s: float = 120.0
    teardown_timeout_s: float = 60.0
    metrics: PodMetrics | None = None
    #: How long an ensure refused for quota is retried from its first refusal
    #: (``SANDBOX_LANES_ADMISSION_TIMEOUT_S``).
    admission_timeout_s: float = 600.0
    quota_first_delay_s: float = QUOTA_FIRST_DELAY_S
    quota_max_delay_s: float = QUOTA_MAX_DELAY_S
    #: The backoff of one wait (a test records the delays it gives).
    quota_backoff: Callable[..., Backoff] = Backoff
    #: The ensures waiting for engine capacity (their wakes, the gauge).
    quota: EngineQuotaWaits = field(init=False)

    def __post_init__(self) -> None:
        self.quota = EngineQuotaWaits(self.metrics)

    async def run(self, command: Command) -> CommandResult:
        started = time.monotonic()
        result = await self._run(command)
        if self.metrics is not None:
            operation = "provisioning" if isinstance(command, Ensure) else "teardown"
            self.metrics.driver_observer(
                self.provisioner.driver_name, operation, "ok" if result.ok else "error"
            ).observe(time.monotonic() - started)
        return result

    # ``asyncio.timeout`` bounds the awaits in this task; ``asyncio.wait_for`` would create a Task per call.

    async def _run(self, command: Command) -> CommandResult:
        if isinstance(command, Ensure):
            return await self._ensure(command)
        bound = asyncio.timeout(self.teardown_timeout_s)
        try:
            async with bound:
                await self.provisioner.deprovision(command.scope, command.sandbox_id)
        except TimeoutError as exc:
            if not bound.expired():
                return CommandResult(ok=False, error=upstream_message(exc))  # the driver's own timeout
            return CommandResult(
                ok=False, error=f"sandbox teardown timed out after {self.teardown_timeout_s:g}s"
            )
        except Exception as exc:
            return CommandResult(ok=False, error=upstream_message(exc))
        self.quota.freed()  # a sandbox ended: capacity may have freed for one waiting ensure
        return CommandResult(ok=True)

    async def _ensure(self, command: Ensure) -> CommandResult:
        result, refused = await self._attempt(command)
        if refused is None:
            return result
        return await self._wait_for_capacity(command, refused)

    async def _wait_for_capacity(self, command: Ensure, refused: CapacityRefused) -> CommandResult:
        """Retry an ensure the engine refused as full until it is admitted, fails otherwise, or
        ``admission_timeout_s`` has passed since the first refusal (``capacity: ...``)."""
        driver = self.provisioner.driver_name
        loop = asyncio.get_running_loop()
        waiter = self.quota.begin(driver)
        backoff = self.quota_backoff(first_s=self.quota_first_delay_s, cap_s=self.quota_max_delay_s)
        where = {"scope": command.scope, "id": command.sandbox_id, "driver": driver}
        self.logger.info(
            "sandbox ensure refused: the engine is full; waiting for capacity",
            extra={**where, "error": upstream_message(refused), "timeoutSeconds": self.admission_timeout_s},
        )
        ended = "abandoned"  # cancelled (shutdown) or its partition moved: the next owner re-runs it
        try:
            while True:
                remaining = self.admission_timeout_s - (loop.time() - waiter.since)
                if remaining <= 0:
                    ended = "timed out"
                    return CommandResult(ok=False, error=capacity_error(refused))
                async with slot_given_up():
                    woken = await waiter.sleep(min(backoff.failed(), remaining))
                if woken:  # a sandbox ended: room is freeing now (an engine may take seconds to show it)
                    backoff.succeeded()
                if not call_current():
                    return CommandResult(ok=False, error=capacity_error(refused))  # discarded by the runner
                waiter.attempts += 1
                result, again = await self._attempt(command)
                if again is None:
                    ended = "admitted" if result.ok else "failed"
                    return result
                refused = again
        finally:
            self.quota.end(waiter, driver, timed_out=ended == "timed out")
            if ended == "admitted":
                self.quota.freed()  # there was room a moment ago: the next waiter tries too
            log = self.logger.warning if ended == "timed out" else self.logger.info
            log(
                f"sandbox ensure's wait for engine capacity ended: {ended}",
                extra={
                    **where,
                    "attempts": waiter.attempts,
                    "seconds": round(loop.time() - waiter.since, 3),
                    "error": upstream_message(refused),
                },
            )

    async def _attempt(self, command: Ensure) -> tuple[CommandResult, CapacityRefused | None]:
        """One ensure (its token minted anew), bounded by ``ensure_timeout_s``; the refusal when the
        engine said it is full."""
        # The mint is part of the ensure (upstream: one try around both), so the bound covers it.
        bound = asyncio.timeout(self.ensure_timeout_s)
        try:
            async with bound:
                token = await mint_sandbox_token(self.credentials, command.mint, self.logger)
                env = SandboxEnvironment(
                    task_queue=command.task_queue, stigmer_token=token, caller_class=command.caller_class
                )
                probe_state: str = await self.provisioner.ensure(command.scope, command.sandbox_id, env)
        except TimeoutError as exc:
            if bound.expired():
                return CommandResult(
                    ok=False, error=f"sandbox ensure timed out after {self.ensure_timeout_s:g}s"
                ), None
            return CommandResult(ok=False, error=upstream_message(exc)), None  # the driver's own timeout
        except CapacityRefused as exc:
            return CommandResult(ok=False, error=capacity_error(exc)), exc
        except Exception as exc:
            return CommandResult(ok=False, error=upstream_message(exc)), None
        return CommandResult(ok=True, probe_state=probe_state, token_minted=token != ""), None
