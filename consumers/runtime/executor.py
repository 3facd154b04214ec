"""The edge where decisions meet the world: mint the runner token, call the driver.

Every failure becomes a :class:`CommandResult` with the error's message; nothing
raises out of here, which is what keeps a provisioning failure from ever
crashing the pod. Timeouts bound a hung driver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from consumers.lanes.commands import Command, CommandResult, Ensure
from consumers.runtime.metrics import PodMetrics
from consumers.runtime.runner_tokens import RunnerCredentialProvider, mint_sandbox_token
from drivers.contract import SandboxEnvironment, SandboxProvisioner


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
        return CommandResult(ok=True)

    async def _ensure(self, command: Ensure) -> CommandResult:
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
                )
            return CommandResult(ok=False, error=upstream_message(exc))  # the driver's own timeout
        except Exception as exc:
            return CommandResult(ok=False, error=upstream_message(exc))
        return CommandResult(ok=True, probe_state=probe_state, token_minted=token != "")
