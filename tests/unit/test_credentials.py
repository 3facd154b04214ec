"""The OSS execution-scoped credential provider (spec 3.1, 3.4) and the mint decision (3.3)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging

import pytest

from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.runtime.runner_tokens import (
    ExecutionScopedRunnerCredentialProvider,
    InvalidTokenError,
    MintingDisabledError,
    mint_sandbox_token,
)

KEY = bytes(range(32))
REQUEST = SandboxCredentialRequest("session", "ses_1", "axr_1", "org", "ida")


def provider() -> ExecutionScopedRunnerCredentialProvider:
    return ExecutionScopedRunnerCredentialProvider(KEY)


def test_mint_is_an_hs256_jwt_with_the_wire_claims_and_verifies_to_its_binding() -> None:
    minted = provider().mint("execution_scoped", "axr_1", 14400)
    header, body, _ = minted.token.split(".")
    assert base64.urlsafe_b64decode(header + "==") == b'{"alg":"HS256","typ":"JWT"}'
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    assert claims["token_type"] == "execution_scoped" and claims["execution_id"] == "axr_1"
    assert claims["exp"] - claims["iat"] == 14400 and minted.ttl_seconds == 14400
    assert provider().verify("execution_scoped", minted.token) == "axr_1"
    assert "token" not in repr(minted) or minted.token not in repr(minted)


def test_default_ttl_and_the_refusals() -> None:
    assert provider().mint("execution_scoped", "x", 0).ttl_seconds == 3600
    with pytest.raises(ValueError, match="execution id is required to mint a runner token"):
        provider().mint("execution_scoped", "", 10)
    with pytest.raises(ValueError) as lane:
        provider().mint("cloud_lane", "x", 10)
    assert (
        str(lane.value)
        == "runner credential lane 'cloud_lane' is not provided by this implementation (provides 'execution_scoped')"
    )
    with pytest.raises(
        MintingDisabledError, match="runner token minting is disabled - no signing key configured"
    ):
        ExecutionScopedRunnerCredentialProvider(None).mint("execution_scoped", "x", 10)


def test_verify_fails_closed() -> None:
    token = provider().mint("execution_scoped", "axr_1", 60).token
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    for bad in (forged, "a.b", "", token + "x"):
        with pytest.raises(InvalidTokenError, match="invalid runner token"):
            provider().verify("execution_scoped", bad)
    with pytest.raises(InvalidTokenError):
        ExecutionScopedRunnerCredentialProvider(bytes(32)).verify("execution_scoped", token)

    class Later(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Later:  # type: ignore[override]
            return cls.fromtimestamp(dt.datetime.now(dt.UTC).timestamp() + 61, tz)

    with pytest.raises(InvalidTokenError):
        ExecutionScopedRunnerCredentialProvider(KEY, now=Later).verify("execution_scoped", token)


def test_from_env_key_handling() -> None:
    assert not ExecutionScopedRunnerCredentialProvider.from_env({}).is_enabled("execution_scoped")
    enabled = ExecutionScopedRunnerCredentialProvider.from_env(
        {"STIGMER_RUNNER_TOKEN_KEY": base64.b64encode(KEY).decode()}
    )
    assert enabled.is_enabled("execution_scoped") and not enabled.is_enabled("other")
    with pytest.raises(ValueError, match="32 bytes"):
        ExecutionScopedRunnerCredentialProvider.from_env(
            {"STIGMER_RUNNER_TOKEN_KEY": base64.b64encode(b"short").decode()}
        )
    with pytest.raises(ValueError, match="base64"):
        ExecutionScopedRunnerCredentialProvider.from_env({"STIGMER_RUNNER_TOKEN_KEY": "!!!"})


async def test_mint_sandbox_token_decision_order(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("t")
    token = await mint_sandbox_token(provider(), REQUEST, log)
    assert provider().verify("execution_scoped", token) == "axr_1"  # binding = the execution id
    with caplog.at_level(logging.WARNING):
        assert await mint_sandbox_token(ExecutionScopedRunnerCredentialProvider(None), REQUEST, log) == ""
    assert caplog.records[-1].executionId == "axr_1"  # type: ignore[attr-defined]

    class Capability(ExecutionScopedRunnerCredentialProvider):
        async def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
            return ""  # "" means launch token-less, and the primitives are not consulted

    assert await mint_sandbox_token(Capability(None), REQUEST, log) == ""

    class Refusing(ExecutionScopedRunnerCredentialProvider):
        def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
            raise PermissionError("scope not known")

    with pytest.raises(PermissionError):
        await mint_sandbox_token(Refusing(KEY), REQUEST, log)
