"""A credential provider with the C4 capability, registered as ``test-capability`` for the tests.

Installed with the dev harness only: ``SANDBOX_LANES_CREDENTIAL_PROVIDER=test-capability`` lets a real
``sandbox-lanes run`` load an operator's provider through the entry point, as a deployment would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.runtime.runner_tokens import MintedCredential


class CapabilityProvider:
    """Decides the whole mint itself: a token naming the scope and the execution (never a secret).

    With ``TEST_CAPABILITY_FAILURES=1`` it also fails the three ways an operator's provider can, chosen
    by the execution id: one containing ``mint_raises`` raises, ``mint_non_string`` returns an int,
    ``mint_hangs`` never answers (an awaitable that does not complete).
    """

    def __init__(self, prefix: str, failures: bool = False) -> None:
        self.prefix = prefix
        self.failures = failures

    def is_enabled(self, lane: str) -> bool:
        return False  # never consulted: the capability decides

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        raise RuntimeError("the capability path never calls mint")

    def verify(self, lane: str, token: str) -> str:
        raise RuntimeError("not a verifier")

    def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> Any:
        if self.failures:
            if "mint_raises" in request.execution_id:
                raise RuntimeError("credential service unavailable")
            if "mint_non_string" in request.execution_id:
                return 42
            if "mint_hangs" in request.execution_id:
                return asyncio.Event().wait()  # never set: the ensure's bound must end it
        return f"{self.prefix}-{request.scope}-{request.execution_id}"


def new_capability_provider(environ: Mapping[str, str], logger: logging.Logger) -> CapabilityProvider:
    logger.info("test capability provider loaded")
    return CapabilityProvider(
        environ.get("TEST_CAPABILITY_PREFIX", "capability-token"),
        failures=environ.get("TEST_CAPABILITY_FAILURES", "") == "1",
    )
