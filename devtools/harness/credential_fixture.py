"""A credential provider with the C4 capability, registered as ``test-capability`` for the tests.

Installed with the dev harness only: ``SANDBOX_LANES_CREDENTIAL_PROVIDER=test-capability`` lets a real
``sandbox-lanes run`` load an operator's provider through the entry point, as a deployment would.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.runtime.runner_tokens import MintedCredential


class CapabilityProvider:
    """Decides the whole mint itself: a token naming the scope and the execution (never a secret)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def is_enabled(self, lane: str) -> bool:
        return False  # never consulted: the capability decides

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        raise RuntimeError("the capability path never calls mint")

    def verify(self, lane: str, token: str) -> str:
        raise RuntimeError("not a verifier")

    def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
        return f"{self.prefix}-{request.scope}-{request.execution_id}"


def new_capability_provider(environ: Mapping[str, str], logger: logging.Logger) -> CapabilityProvider:
    logger.info("test capability provider loaded")
    return CapabilityProvider(environ.get("TEST_CAPABILITY_PREFIX", "capability-token"))
