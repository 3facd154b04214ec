"""Kafka TLS / SASL from the configuration: what is accepted, what is refused at start-up, and
that the credentials are secrets (masked, redacted, never a runner's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.ops.settings import RUNNER_WITHHELD_ENV, ConfigError, load_settings
from consumers.runtime.kafka.security import FileOrCommandTokenProvider, KafkaSecurity


def _settings(**env: str):  # type: ignore[no-untyped-def]
    return load_settings({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9093", **env})


def test_plaintext_is_the_default_and_adds_no_client_option() -> None:
    security = _settings().kafka_security
    assert security == KafkaSecurity() and security.client_options() == {}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAFKA_SECURITY_PROTOCOL='TLS' is invalid"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "GSSAPI"},
            "KAFKA_SASL_MECHANISM='GSSAPI' is invalid for SASL_SSL",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512"},
            "SCRAM-SHA-512 needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD",
        ),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "OAUTHBEARER"},
            "OAUTHBEARER needs exactly one of",
        ),
        (
            {"KAFKA_SASL_MECHANISM": "PLAIN", "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"},
            "does not use SASL",
        ),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CA_FILE": "/nope/ca.pem"}, "is not a readable file"),
        ({"KAFKA_SSL_CA_FILE": "/etc/hostname"}, "does not use TLS"),
        (
            {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CERT_FILE": "/etc/hostname"},
            "KAFKA_SSL_CERT_FILE and KAFKA_SSL_KEY_FILE go together",
        ),
        (
            {"KAFKA_SASL_PASSWORD": "a", "KAFKA_SASL_PASSWORD_FILE": "/etc/hostname"},
            "KAFKA_SASL_PASSWORD and KAFKA_SASL_PASSWORD_FILE are both set",
        ),
        ({"KAFKA_SASL_PASSWORD_FILE": "/nope/pw"}, "KAFKA_SASL_PASSWORD_FILE='/nope/pw' cannot be read"),
    ],
)
def test_a_security_setting_that_cannot_connect_fails_at_start_up_naming_it(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _settings(**env)


def test_sasl_ssl_scram_with_the_password_from_a_file_is_a_secret_everywhere(tmp_path: Path) -> None:
    password_file = tmp_path / "kafka-password"
    password_file.write_text("s3cret-kafka-pw\n")
    settings = _settings(
        KAFKA_SECURITY_PROTOCOL="sasl_ssl",
        KAFKA_SASL_MECHANISM="scram-sha-512",
        KAFKA_SASL_USERNAME="sandbox-lanes",
        KAFKA_SASL_PASSWORD_FILE=str(password_file),
    )
    security = settings.kafka_security
    options = security.client_options()
    assert options["security_protocol"] == "SASL_SSL" and options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_username"] == "sandbox-lanes"
    assert options["sasl_plain_password"] == "s3cret-kafka-pw"
    assert options["ssl_context"].check_hostname  # the system's CAs, host names verified
    assert "s3cret-kafka-pw" in settings.secret_values  # what the log formatter scrubs
    assert "s3cret-kafka-pw" not in repr(settings) and "s3cret-kafka-pw" not in repr(security)
    assert "s3cret-kafka-pw" not in str(settings.effective())
    # None of the pod's Kafka identity reaches a local-process runner.
    assert {
        "KAFKA_SECURITY_PROTOCOL",
        "KAFKA_SASL_USERNAME",
        "KAFKA_SASL_PASSWORD",
        "KAFKA_SASL_PASSWORD_FILE",
        "KAFKA_SSL_KEY_FILE",
        "KAFKA_SSL_KEY_PASSWORD",
        "KAFKA_SASL_OAUTHBEARER_TOKEN_FILE",
        "KAFKA_SASL_OAUTHBEARER_TOKEN_COMMAND",
    } <= RUNNER_WITHHELD_ENV


async def test_an_oauthbearer_token_is_read_fresh_at_every_login(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first.token.jwt\n")
    settings = _settings(
        KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT",
        KAFKA_SASL_MECHANISM="OAUTHBEARER",
        KAFKA_SASL_OAUTHBEARER_TOKEN_FILE=str(token_file),
    )
    provider = settings.kafka_security.client_options()["sasl_oauth_token_provider"]
    assert await provider.token() == "first.token.jwt"
    token_file.write_text("rotated.token.jwt")
    assert await provider.token() == "rotated.token.jwt"
    command = FileOrCommandTokenProvider("", "printf %s from.a.command")
    assert await command.token() == "from.a.command"
    with pytest.raises(ValueError, match="exited 1"):
        await FileOrCommandTokenProvider("", "false").token()
