"""Minting and verifying runner tokens at the edge (spec section 3): the credential provider contract,
the optional capability, upstream's ``mintSandboxToken`` decision order, and the HMAC provider.

The mint is the one step that produces a secret. The executor calls it right before the driver call;
the token is never part of a decision, a state record, an event or a log line.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import hmac
import inspect
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol, runtime_checkable

from consumers.lanes.constants import (
    DEFAULT_TOKEN_TTL_SECONDS,
    EXECUTION_ID_REQUIRED_MESSAGE,
    INVALID_RUNNER_TOKEN_MESSAGE,
    LOG_TOKENLESS_LAUNCH,
    MINTING_DISABLED_MESSAGE,
    SANDBOX_TOKEN_TTL_SECONDS,
    TOKEN_TYPE_EXECUTION_SCOPED,
    lane_not_provided_message,
)
from consumers.lanes.credentials import SandboxCredentialRequest


@dataclass(frozen=True)
class MintedCredential:
    token: str = field(repr=False)
    ttl_seconds: int


class MintingDisabledError(RuntimeError):
    def __init__(self) -> None:
        super().__init__(MINTING_DISABLED_MESSAGE)


class InvalidTokenError(ValueError):
    def __init__(self) -> None:
        super().__init__(INVALID_RUNNER_TOKEN_MESSAGE)


@runtime_checkable
class RunnerCredentialProvider(Protocol):
    def is_enabled(self, lane: str) -> bool: ...

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential: ...

    def verify(self, lane: str, token: str) -> str: ...


@runtime_checkable
class SandboxCredentialCapability(Protocol):
    """Optional capability: when present it makes the WHOLE mint decision ("" = token-less)."""

    def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str | Awaitable[str]: ...


async def mint_sandbox_token(
    credentials: RunnerCredentialProvider, request: SandboxCredentialRequest, logger: logging.Logger
) -> str:
    """Upstream ``mintSandboxToken``, in decision order. A mint failure propagates."""
    capability = getattr(credentials, "mint_sandbox_credential", None)
    if callable(capability):
        result = capability(request)
        token: object = await result if inspect.isawaitable(result) else result
        if not isinstance(token, str):
            # Anything else would reach the runner as a token it cannot use, and the outcome
            # would claim a minted token: the ensure fails instead.
            raise TypeError(
                "the credential provider's mint_sandbox_credential returned "
                f"{type(token).__name__}, not a string"
            )
        return token
    if not credentials.is_enabled(TOKEN_TYPE_EXECUTION_SCOPED):
        logger.warning(LOG_TOKENLESS_LAUNCH, extra={"executionId": request.execution_id})
        return ""
    return credentials.mint(
        TOKEN_TYPE_EXECUTION_SCOPED, request.execution_id, SANDBOX_TOKEN_TTL_SECONDS
    ).token


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_JWT_HEADER = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
_CLAIMS_HEAD = '{"token_type":' + json.dumps(TOKEN_TYPE_EXECUTION_SCOPED) + ',"execution_id":'


def _claims_json(binding: str, iat: int, exp: int) -> str:
    """``json.dumps({"token_type", "execution_id", "iat", "exp"}, separators=(",", ":"))``, byte for byte.

    Formatted directly for the types the mint passes (a str binding, int times); anything else takes
    ``json.dumps`` itself.
    """
    if type(binding) is str and type(iat) is int and type(exp) is int:
        return f'{_CLAIMS_HEAD}{json.dumps(binding)},"iat":{iat},"exp":{exp}}}'
    claims = {"token_type": TOKEN_TYPE_EXECUTION_SCOPED, "execution_id": binding, "iat": iat, "exp": exp}
    return json.dumps(claims, separators=(",", ":"))


class ExecutionScopedRunnerCredentialProvider:
    """The OSS default (RunnerAuthService): HS256 JWTs on the ``execution_scoped`` lane.

    Hand-written over hmac/hashlib rather than PyJWT on purpose: upstream pins the
    exact header bytes (``{"alg":"HS256","typ":"JWT"}``) and verify order, which a
    general JWT library does not promise to reproduce.

    Deviation: upstream auto-generates a key when none is configured, because the
    server is also the verifier. This pod is not the verifier, so without a key the
    lane is disabled and sandboxes launch token-less (with the upstream warning).
    """

    def __init__(self, key: bytes | None, *, now: type[dt.datetime] = dt.datetime) -> None:
        self._key = key
        self._now = now

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ExecutionScopedRunnerCredentialProvider:
        env = os.environ if environ is None else environ
        raw = env.get("STIGMER_RUNNER_TOKEN_KEY", "")
        path = env.get("STIGMER_RUNNER_TOKEN_KEY_FILE", "")
        if not raw and path:
            raw = Path(path).read_text().strip()
        return cls.from_key_text(raw)

    @classmethod
    def from_key_text(cls, raw: str) -> ExecutionScopedRunnerCredentialProvider:
        """From the key's base64 text ("" = no key: minting disabled)."""
        if not raw:
            return cls(None)
        try:
            key = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("STIGMER_RUNNER_TOKEN_KEY is not valid base64") from exc
        if len(key) != 32:
            raise ValueError(f"STIGMER_RUNNER_TOKEN_KEY must decode to 32 bytes, got {len(key)}")
        return cls(key)

    def is_enabled(self, lane: str) -> bool:
        return lane == TOKEN_TYPE_EXECUTION_SCOPED and self._key is not None

    def mint(self, lane: str, binding: str, ttl_seconds: int) -> MintedCredential:
        if lane != TOKEN_TYPE_EXECUTION_SCOPED:
            raise ValueError(lane_not_provided_message(lane))
        if self._key is None:
            raise MintingDisabledError()
        if not binding:
            raise ValueError(EXECUTION_ID_REQUIRED_MESSAGE)
        ttl = ttl_seconds if ttl_seconds > 0 else DEFAULT_TOKEN_TTL_SECONDS
        iat = int(self._now.now(dt.UTC).timestamp())
        body = _b64url(_claims_json(binding, iat, iat + ttl).encode())
        signing_input = f"{_JWT_HEADER}.{body}".encode()
        signature = _b64url(hmac.digest(self._key, signing_input, "sha256"))
        return MintedCredential(token=f"{_JWT_HEADER}.{body}.{signature}", ttl_seconds=ttl)

    def verify(self, lane: str, token: str) -> str:
        """Fail closed: any problem is :class:`InvalidTokenError`."""
        if lane != TOKEN_TYPE_EXECUTION_SCOPED or self._key is None:
            raise InvalidTokenError()
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _JWT_HEADER:
            raise InvalidTokenError()
        expected = _b64url(hmac.new(self._key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, parts[2]):
            raise InvalidTokenError()
        try:
            claims = json.loads(_b64url_decode(parts[1]))
        except (ValueError, binascii.Error) as exc:
            raise InvalidTokenError() from exc
        if not isinstance(claims, dict):  # a signed body that is not a JSON object
            raise InvalidTokenError()
        binding = claims.get("execution_id")
        if claims.get("token_type") != TOKEN_TYPE_EXECUTION_SCOPED or not binding:
            raise InvalidTokenError()
        exp = claims.get("exp")
        if not isinstance(exp, int) or int(self._now.now(dt.UTC).timestamp()) >= exp:
            raise InvalidTokenError()
        return str(binding)


#: Where an operator's credential provider registers (upstream: the extension-registered provider).
CREDENTIALS_ENTRY_POINT_GROUP = "sandbox_lanes.credentials"
CredentialProviderFactory = Callable[[Mapping[str, str], logging.Logger], RunnerCredentialProvider]


def credential_provider_names() -> list[str]:
    """The installed credential providers, by entry-point name, sorted."""
    return sorted({ep.name for ep in entry_points(group=CREDENTIALS_ENTRY_POINT_GROUP)})


def load_credential_provider(
    name: str, environ: Mapping[str, str], logger: logging.Logger
) -> RunnerCredentialProvider:
    """Build the provider registered as ``name``: its factory gets the pod's environment and a logger."""
    found = [ep for ep in entry_points(group=CREDENTIALS_ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        known = ", ".join(f"'{n}'" for n in credential_provider_names()) or "none installed"
        raise ValueError(f"unknown credential provider '{name}' — known providers: {known}")
    factory: CredentialProviderFactory = found[0].load()
    provider = factory(environ, logger)
    if not isinstance(provider, RunnerCredentialProvider):
        raise TypeError(
            f"credential provider '{name}' built a {type(provider).__name__}, which is not a "
            "RunnerCredentialProvider (is_enabled, mint, verify)"
        )
    return provider
