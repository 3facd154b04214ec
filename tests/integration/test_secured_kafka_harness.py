"""The harness's secured Kafka broker works with aiokafka: SCRAM, PLAIN, OAUTHBEARER, mTLS and ACLs."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import struct
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import AbstractTokenProvider
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError
from aiokafka.helpers import create_ssl_context
from harness.kafka_broker import KafkaBroker

pytestmark = pytest.mark.kafka

RUN = uuid.uuid4().hex[:8]


def sasl(
    broker: KafkaBroker, mechanism: str, user: str = "", password: str = "", **extra: Any
) -> dict[str, Any]:
    return {
        "bootstrap_servers": broker.sasl_ssl_bootstrap,
        "security_protocol": "SASL_SSL",
        "ssl_context": create_ssl_context(cafile=str(broker.ca_file)),
        "sasl_mechanism": mechanism,
        "sasl_plain_username": user or None,
        "sasl_plain_password": password or None,
        **extra,
    }


def admin_sasl(broker: KafkaBroker) -> dict[str, Any]:
    return sasl(broker, "SCRAM-SHA-512", broker.admin_user, broker.admin_password)


class UnsecuredJwt(AbstractTokenProvider):
    """An unsigned JWT (alg "none") for Kafka's built-in unsecured OAUTHBEARER validator."""

    def __init__(self, sub: str) -> None:
        self.sub = sub

    async def token(self) -> str:
        def part(obj: dict[str, Any]) -> str:
            return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

        now = int(time.time())
        return f"{part({'alg': 'none'})}.{part({'sub': self.sub, 'iat': now, 'exp': now + 3600})}."


async def create_topic(broker: KafkaBroker) -> str:
    name = f"sec-{RUN}-{uuid.uuid4().hex[:6]}"
    admin = AIOKafkaAdminClient(**admin_sasl(broker))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1)])
    finally:
        await admin.close()
    return name


async def produce(options: dict[str, Any], topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(acks="all", request_timeout_ms=10_000, **options)
    try:
        await producer.start()
        await producer.send_and_wait(topic, value)
    finally:
        await producer.stop()


async def produce_eventually(options: dict[str, Any], topic: str, value: bytes) -> None:
    """An ACL just added reaches the broker's authorizer asynchronously: retry briefly."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return await produce(options, topic, value)
        except TopicAuthorizationFailedError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def consume(options: dict[str, Any], topic: str, count: int, group: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False, **options
    )
    await consumer.start()
    try:
        got: list[bytes] = []
        while len(got) < count:
            batches = await consumer.getmany(timeout_ms=10_000)
            assert batches, f"timed out after {len(got)} of {count} records"
            got += [r.value for records in batches.values() for r in records]
        return got
    finally:
        await consumer.stop()


async def test_admin_scram_sha512_creates_produces_and_consumes(secured_kafka: KafkaBroker) -> None:
    topic = await create_topic(secured_kafka)
    await produce(admin_sasl(secured_kafka), topic, b"hello")
    assert await consume(admin_sasl(secured_kafka), topic, 1, f"g-{topic}") == [b"hello"]


async def test_new_scram_user_is_denied_until_an_acl_allows_it(secured_kafka: KafkaBroker) -> None:
    topic = await create_topic(secured_kafka)
    user, password = f"writer-{RUN}", f"pw-{uuid.uuid4().hex}"
    secured_kafka.add_scram_user(user, password, "SCRAM-SHA-256")
    options = sasl(secured_kafka, "SCRAM-SHA-256", user, password)
    with pytest.raises(TopicAuthorizationFailedError):
        await produce(options, topic, b"denied")

    out = secured_kafka.kafka_acls(
        "--add", "--allow-principal", f"User:{user}", "--operation", "Write", "--topic", topic
    )
    assert f"User:{user}" in out.stdout
    await produce_eventually(options, topic, b"allowed")
    assert await consume(admin_sasl(secured_kafka), topic, 1, f"g-{topic}") == [b"allowed"]

    listed = secured_kafka.kafka_acls("--list", "--topic", topic).stdout
    assert f"principal=User:{user}" in listed and "operation=WRITE" in listed


async def test_wrong_scram_password_fails_authentication(secured_kafka: KafkaBroker) -> None:
    with pytest.raises(KafkaConnectionError):
        await produce(
            sasl(secured_kafka, "SCRAM-SHA-512", secured_kafka.admin_user, "not-the-password"), "x", b""
        )


async def test_mtls_client_cert_is_user_cn_on_the_ssl_listener(secured_kafka: KafkaBroker) -> None:
    topic = await create_topic(secured_kafka)
    cn = f"mtls-{RUN}"
    cert, key = secured_kafka.client_cert(cn)
    group = f"g-{topic}"
    secured_kafka.kafka_acls(
        "--add", "--allow-principal", f"User:{cn}", "--producer", "--consumer", "--topic", topic, "--group", group
    )  # fmt: skip
    options = {
        "bootstrap_servers": secured_kafka.ssl_bootstrap,
        "security_protocol": "SSL",
        "ssl_context": create_ssl_context(
            cafile=str(secured_kafka.ca_file), certfile=str(cert), keyfile=str(key)
        ),
    }
    await produce_eventually(options, topic, b"mtls")
    assert await consume(options, topic, 1, group) == [b"mtls"]


async def test_plain_and_oauthbearer_log_in_as_their_principals(secured_kafka: KafkaBroker) -> None:
    topic = await create_topic(secured_kafka)
    sub = f"oauth-{RUN}"
    assert set(secured_kafka.plain_users) >= {"admin", "plainuser"}
    secured_kafka.kafka_acls(
        "--add", "--allow-principal", "User:plainuser", "--allow-principal", f"User:{sub}",
        "--operation", "Write", "--topic", topic,
    )  # fmt: skip
    plain = sasl(secured_kafka, "PLAIN", "plainuser", secured_kafka.plain_users["plainuser"])
    await produce_eventually(plain, topic, b"plain")
    oauth = sasl(secured_kafka, "OAUTHBEARER", sasl_oauth_token_provider=UnsecuredJwt(sub))
    await produce_eventually(oauth, topic, b"oauth")
    assert sorted(await consume(admin_sasl(secured_kafka), topic, 2, f"g-{topic}")) == [b"oauth", b"plain"]
    # an OAUTHBEARER principal with no ACL is still denied
    with pytest.raises(TopicAuthorizationFailedError):
        await produce(
            sasl(secured_kafka, "OAUTHBEARER", sasl_oauth_token_provider=UnsecuredJwt("nobody")), topic, b""
        )


def api_versions(port: int, context: ssl.SSLContext) -> bytes:
    """One ApiVersions v0 round trip over TLS (raises when the broker rejects the TLS client)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
    ):
        payload = struct.pack(">hhih", 18, 0, 1, 1) + b"t"
        sock.sendall(struct.pack(">i", len(payload)) + payload)
        size = struct.unpack(">i", sock.recv(4))[0]
        return sock.recv(size)


def test_tls_material_expired_cert_and_foreign_ca_are_rejected(secured_kafka: KafkaBroker) -> None:
    port = int(secured_kafka.ssl_bootstrap.rsplit(":", 1)[1])
    assert secured_kafka.ca_file.parent == secured_kafka.tls_dir
    cert, key = secured_kafka.client_cert(f"tls-{RUN}")
    assert api_versions(
        port, create_ssl_context(cafile=str(secured_kafka.ca_file), certfile=str(cert), keyfile=str(key))
    )

    cert, key = secured_kafka.client_cert(f"tls-{RUN}", expired=True)
    expired = create_ssl_context(cafile=str(secured_kafka.ca_file), certfile=str(cert), keyfile=str(key))
    with pytest.raises((ssl.SSLError, ConnectionError, struct.error)):
        api_versions(port, expired)

    foreign = create_ssl_context(cafile=str(secured_kafka.foreign_ca_file))
    with pytest.raises(ssl.SSLCertVerificationError):
        api_versions(secured_kafka.port, foreign)


def test_secrets_stay_out_of_argv_and_logs(
    secured_kafka: KafkaBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    argvs: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        argvs.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recording_run)  # what the harness runs its tools with
    password = f"pw-{uuid.uuid4().hex}"
    secured_kafka.add_scram_user(f"argv-{RUN}", password)
    assert argvs and all(password not in arg for argv in argvs for arg in argv)

    work = secured_kafka.work_dir
    assert work is not None and secured_kafka.pid is not None
    cmdline = Path(f"/proc/{secured_kafka.pid}/cmdline").read_bytes().decode()
    secrets = [password, secured_kafka.admin_password, *secured_kafka.plain_users.values()]
    assert not [s for s in secrets if s in cmdline]
    for log in [*work.glob("logs/*"), *work.glob("tool-logs/*"), work / "console.log"]:
        text = log.read_text(errors="replace")
        assert not [s for s in secrets if s in text], log
    for private in (work / "server.properties", secured_kafka.admin_client_config):
        assert private.stat().st_mode & 0o077 == 0, private
