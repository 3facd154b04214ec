"""How the pod's Kafka clients authenticate: TLS, mTLS and SASL, as aiokafka's own options.

Every client the pod or its tools open (group consumer, transactional producers, admin, the
readers of ``replay`` and ``tail``) takes :meth:`KafkaSecurity.client_options`, so one
configuration secures them all. The TLS context is Python's (``aiokafka.helpers.
create_ssl_context``); SASL PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER are aiokafka's. Nothing
here implements crypto. Secrets are fields hidden from ``repr``; an OAUTHBEARER token is read
from its file (or command) each time the client asks, so a rotated token is picked up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import shlex
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context

SECURITY_PROTOCOLS: Final = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
#: How long an OAUTHBEARER token command may run.
TOKEN_COMMAND_TIMEOUT_S: Final = 30.0


class KafkaSecurityError(ValueError):
    """The Kafka security settings cannot work (named setting, reason)."""


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    key_password: str = field(default="", repr=False)
    check_hostname: bool = True
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)
    oauth_token_file: str = ""
    oauth_token_command: str = ""

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @property
    def secret_values(self) -> list[str]:
        return [v for v in (self.key_password, self.sasl_password) if v]

    def validate(self) -> None:
        """Raise :class:`KafkaSecurityError` for a combination that cannot connect."""
        if self.protocol not in SECURITY_PROTOCOLS:
            raise KafkaSecurityError(
                f"KAFKA_SECURITY_PROTOCOL={self.protocol!r} is invalid: "
                f"one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        if not self.uses_tls and (self.ca_file or self.cert_file or self.key_file):
            raise KafkaSecurityError(
                f"KAFKA_SSL_* files are set but KAFKA_SECURITY_PROTOCOL={self.protocol} does not use TLS"
            )
        if bool(self.cert_file) != bool(self.key_file):
            raise KafkaSecurityError("KAFKA_SSL_CERT_FILE and KAFKA_SSL_KEY_FILE go together (mTLS)")
        for name, path in (
            ("KAFKA_SSL_CA_FILE", self.ca_file),
            ("KAFKA_SSL_CERT_FILE", self.cert_file),
            ("KAFKA_SSL_KEY_FILE", self.key_file),
            ("KAFKA_SASL_OAUTHBEARER_TOKEN_FILE", self.oauth_token_file),
        ):
            if path and not Path(path).is_file():
                raise KafkaSecurityError(f"{name}={path!r} is not a readable file")
        if self.cert_file:
            _check_certificate_dates(self.cert_file)
        if not self.uses_sasl:
            if self.sasl_mechanism:
                raise KafkaSecurityError(
                    f"KAFKA_SASL_MECHANISM is set but KAFKA_SECURITY_PROTOCOL={self.protocol} "
                    "does not use SASL"
                )
            return
        if self.sasl_mechanism not in SASL_MECHANISMS:
            raise KafkaSecurityError(
                f"KAFKA_SASL_MECHANISM={self.sasl_mechanism!r} is invalid for {self.protocol}: one of "
                f"{', '.join(SASL_MECHANISMS)}"
            )
        if self.sasl_mechanism == "OAUTHBEARER":
            if bool(self.oauth_token_file) == bool(self.oauth_token_command):
                raise KafkaSecurityError(
                    "OAUTHBEARER needs exactly one of KAFKA_SASL_OAUTHBEARER_TOKEN_FILE and "
                    "KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND"
                )
        elif not self.sasl_username or not self.sasl_password:
            raise KafkaSecurityError(
                f"{self.sasl_mechanism} needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD (or its _FILE)"
            )

    def ssl_context(self) -> ssl.SSLContext:
        """TLS 1.2+, the configured CA (else the system's), the client pair for mTLS."""
        context: ssl.SSLContext = create_ssl_context(
            cafile=self.ca_file or None,
            certfile=self.cert_file or None,
            keyfile=self.key_file or None,
            password=self.key_password or None,
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = self.check_hostname
        return context

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for any aiokafka client (consumer, producer, admin)."""
        if self.protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.uses_tls:
            options["ssl_context"] = self.ssl_context()
        if self.uses_sasl:
            options["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                options["sasl_oauth_token_provider"] = FileOrCommandTokenProvider(
                    self.oauth_token_file, self.oauth_token_command
                )
            else:
                options["sasl_plain_username"] = self.sasl_username
                options["sasl_plain_password"] = self.sasl_password
        return options

    def librdkafka_options(self) -> dict[str, Any]:
        """The same security as librdkafka's options (the ``exactly_once`` producers)."""
        if self.protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security.protocol": self.protocol}
        if self.uses_tls:
            if self.ca_file:
                options["ssl.ca.location"] = self.ca_file
            if self.cert_file:
                options["ssl.certificate.location"] = self.cert_file
                options["ssl.key.location"] = self.key_file
            if self.key_password:
                options["ssl.key.password"] = self.key_password
            options["ssl.endpoint.identification.algorithm"] = "https" if self.check_hostname else "none"
        if self.uses_sasl:
            options["sasl.mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism == "OAUTHBEARER":
                provider = FileOrCommandTokenProvider(self.oauth_token_file, self.oauth_token_command)
                options["oauth_cb"] = provider.librdkafka_token
            else:
                options["sasl.username"] = self.sasl_username
                options["sasl.password"] = self.sasl_password
        return options


def _check_certificate_dates(path: str) -> None:
    """An expired (or not yet valid) client certificate is refused at start-up, naming its dates:
    the broker would only close the connection, which the client cannot tell from a network fault."""
    try:
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]  # stdlib's own reader
        not_before = ssl.cert_time_to_seconds(decoded["notBefore"])
        not_after = ssl.cert_time_to_seconds(decoded["notAfter"])
    except (AttributeError, KeyError, ValueError, ssl.SSLError):
        return  # not readable here: the TLS handshake will judge it
    now = time.time()
    if now > not_after:
        raise KafkaSecurityError(
            f"KAFKA_SSL_CERT_FILE={path!r}: the client certificate expired on {decoded['notAfter']}"
        )
    if now < not_before:
        raise KafkaSecurityError(
            f"KAFKA_SSL_CERT_FILE={path!r}: the client certificate is not valid before {decoded['notBefore']}"
        )


class ConnectFailureNote(logging.Handler):
    """Remembers aiokafka's last connection failure (it logs the reason, then raises a bare
    ``Unable to bootstrap``), so the pod's own error can say why: bad credentials, an untrusted
    certificate, a refused connection."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Unable connect to"):
            self.last = message

    def __enter__(self) -> ConnectFailureNote:
        logging.getLogger("aiokafka").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("aiokafka").removeHandler(self)


#: No TLS, no SASL: the default of every client.
PLAINTEXT: Final = KafkaSecurity()


class FileOrCommandTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """An OAUTHBEARER token read fresh from a file (e.g. a projected service-account token) or
    printed by a command (no shell; argv split like a shell would)."""

    def __init__(self, token_file: str, command: str) -> None:
        self._file = token_file
        self._command = command

    async def token(self) -> str:
        """aiokafka's provider: the token read off the event loop."""
        return await asyncio.to_thread(self.read)

    def librdkafka_token(self, _config: str) -> tuple[str, float, str, dict[str, str]]:
        """librdkafka's ``oauth_cb`` (called in librdkafka's thread): the same token, when it
        expires (its JWT ``exp``, else in 5 minutes, after which librdkafka asks again) and the
        principal (its ``sub``)."""
        token = self.read()
        claims = _jwt_claims(token)
        expires = claims.get("exp")
        expiry = float(expires) if isinstance(expires, int | float) else time.time() + 300.0
        subject = claims.get("sub")
        return token, expiry, subject if isinstance(subject, str) and subject else "sandbox-lanes", {}

    def read(self) -> str:
        """The token, from the file or the command's output (blocking: both clients call it off
        their event loop)."""
        if self._file:
            text = Path(self._file).read_text()
        else:
            try:
                proc = subprocess.run(  # argv of the configured command, no shell
                    shlex.split(self._command),
                    capture_output=True,
                    timeout=TOKEN_COMMAND_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(
                    f"KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND ran over {TOKEN_COMMAND_TIMEOUT_S:g}s"
                ) from exc
            if proc.returncode != 0:
                raise KafkaSecurityError(
                    f"KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND exited {proc.returncode}: "
                    f"{proc.stderr.decode(errors='replace').strip()[:200]}"
                )
            text = proc.stdout.decode()
        token = text.strip()
        if not token:
            raise KafkaSecurityError("the OAUTHBEARER token is empty")
        return token


def _jwt_claims(token: str) -> dict[str, Any]:
    """A JWT's claims, unverified (only its expiry and subject are read, to schedule a refresh)."""
    parts = token.split(".")
    if len(parts) < 2:
        return {}
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except (ValueError, binascii.Error):
        return {}
    return claims if isinstance(claims, dict) else {}
