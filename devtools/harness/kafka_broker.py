"""A real single-node Apache Kafka (KRaft) broker for tests and local scripts.

Stdlib only. ``prepare`` fetches Kafka and its runtime dependencies from Maven Central into a cache
outside the repo; ``KafkaBroker`` formats a fresh KRaft data dir, runs ``kafka.Kafka`` on free
loopback ports and waits until the broker is registered and unfenced.

CLI::

    python -m harness.kafka_broker prepare
    python -m harness.kafka_broker start   # prints bootstrap + pid, writes a state file
    python -m harness.kafka_broker stop

``KafkaBroker(secured=True)`` is the opt-in secured variant: SASL_SSL (SCRAM-SHA-256/512, PLAIN,
unsecured-JWT OAUTHBEARER) and mTLS SSL listeners, the StandardAuthorizer with no ACL meaning deny, TLS
material from ``harness.kafka_tls``. Its secrets live only in 0600 files of its work dir, never in argv.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.cache import cache_root, locked
from harness.kafka_tls import TlsMaterial
from harness.kafka_tls import generate as generate_tls

KAFKA_VERSION = "4.4.0"
LOG4J_VERSION = "2.25.5"  # matches the log4j-core that kafka_2.13 4.4.0 depends on
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"
BROKER_MAIN = "kafka.Kafka"
ACL_MAIN = "org.apache.kafka.tools.AclCommand"  # kafka-acls.sh
CONFIG_MAIN = "org.apache.kafka.tools.ConfigCommand"  # kafka-configs.sh
DEFAULT_JVM_OPTS = (
    "-Xms256m",
    "-Xmx1g",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)
TOOL_JVM_OPTS = (
    "-Xms32m",
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)

POM_XML = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.sandbox-lanes</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>{KAFKA_VERSION}</version>
    </dependency>
    <dependency>
      <!-- kafka-acls / kafka-configs (AclCommand, ConfigCommand) for the secured broker; not Connect -->
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka-tools</artifactId>
      <version>{KAFKA_VERSION}</version>
      <exclusions>
        <exclusion>
          <groupId>org.apache.kafka</groupId>
          <artifactId>connect-runtime</artifactId>
        </exclusion>
      </exclusions>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
  </dependencies>
</project>
"""

LOG4J2_XML = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <File name="file" fileName="${sys:kafka.logs.dir}/server.log">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="org.apache.kafka.clients" level="WARN"/>
    <Root level="INFO"><AppenderRef ref="file"/></Root>
  </Loggers>
</Configuration>
"""


class KafkaBrokerError(RuntimeError):
    """The broker could not be prepared, formatted, started or reached."""


def cache_dir() -> Path:
    return cache_root() / f"kafka-{KAFKA_VERSION}"


def _fingerprint() -> str:
    return hashlib.sha256((POM_XML + LOG4J2_XML).encode()).hexdigest()


def prepare(directory: Path | None = None) -> Path:
    """Fetch Kafka + runtime deps into the cache (idempotent) and return the cache dir."""
    directory = directory or cache_dir()
    marker = directory / ".complete"
    if marker.is_file() and marker.read_text() == _fingerprint():
        return directory
    with locked(directory / ".lock"):
        if marker.is_file() and marker.read_text() == _fingerprint():
            return directory
        marker.unlink(missing_ok=True)
        lib = directory / "lib"
        shutil.rmtree(lib, ignore_errors=True)
        (directory / "pom.xml").write_text(POM_XML)
        (directory / "log4j2.xml").write_text(LOG4J2_XML)
        cmd = [
            "mvn", "-B", "-q", "-f", str(directory / "pom.xml"), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={lib}",
        ]  # fmt: skip
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except FileNotFoundError as exc:
            raise KafkaBrokerError("mvn not found on PATH; install Maven and Java 17+") from exc
        if result.returncode != 0:
            out = (result.stdout + result.stderr)[-4000:]
            raise KafkaBrokerError(f"mvn failed ({result.returncode}) fetching Kafka {KAFKA_VERSION}:\n{out}")
        if not (lib / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
            raise KafkaBrokerError(f"mvn finished but {lib} has no kafka_2.13-{KAFKA_VERSION}.jar")
        marker.write_text(_fingerprint())
    return directory


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cluster_id() -> str:
    while True:  # Kafka's own Uuid.randomUuid() also rejects ids starting with "-"
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


# --- minimal Kafka wire protocol: ApiVersions v0 then Metadata v4..v8 (non-flexible) ---------------


def _roundtrip(sock: socket.socket, api_key: int, version: int, body: bytes) -> bytes:
    client_id = b"kafka_broker.py"
    header = struct.pack(">hhih", api_key, version, 1, len(client_id)) + client_id
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    size = struct.unpack(">i", _recv_exact(sock, 4))[0]
    return _recv_exact(sock, size)[4:]  # drop the correlation id (response header v0)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


@contextlib.contextmanager
def _connect(
    host: str, port: int, timeout: float, ssl_context: ssl.SSLContext | None
) -> Iterator[socket.socket]:
    with socket.create_connection((host, port), timeout=timeout) as raw:
        if ssl_context is None:
            yield raw
            return
        with ssl_context.wrap_socket(raw, server_hostname=host) as sock:
            yield sock


def alive_brokers(
    host: str, port: int, timeout: float = 2.0, *, ssl_context: ssl.SSLContext | None = None
) -> int:
    """Number of unfenced brokers the broker at host:port reports in a Metadata response."""
    with _connect(host, port, timeout, ssl_context) as sock:
        resp = _roundtrip(sock, 18, 0, b"")  # ApiVersions v0
        error, count = struct.unpack_from(">hi", resp, 0)
        ranges = {}
        for i in range(count):
            key, lo, hi = struct.unpack_from(">hhh", resp, 6 + 6 * i)
            ranges[key] = (lo, hi)
        if error or 3 not in ranges:
            raise ConnectionError(f"ApiVersions error {error}")
        lo, hi = ranges[3]
        version = max(lo, 4)
        if version > min(hi, 8):
            raise ConnectionError(f"no non-flexible Metadata version in {lo}..{hi}")
        body = struct.pack(">i", -1) + b"\x00"  # all topics, allow_auto_topic_creation=false
        if version >= 8:
            body += b"\x00\x00"  # include cluster/topic authorized operations = false
        resp = _roundtrip(sock, 3, version, body)
        return int(struct.unpack_from(">i", resp, 4)[0])  # skip throttle_time_ms


# DescribeUserScramCredentials v0 (flexible: request header v2, response header v1)
_SCRAM_MECHANISMS = {1: "SCRAM-SHA-256", 2: "SCRAM-SHA-512"}


def _uvarint(value: int) -> bytes:
    out = b""
    while value >= 0x80:
        out += bytes([(value & 0x7F) | 0x80])
        value >>= 7
    return out + bytes([value])


def _read_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _read_compact_string(buf: bytes, pos: int) -> tuple[str | None, int]:
    length, pos = _read_uvarint(buf, pos)
    if length == 0:
        return None, pos
    return buf[pos : pos + length - 1].decode(), pos + length - 1


def _skip_tags(buf: bytes, pos: int) -> int:
    count, pos = _read_uvarint(buf, pos)
    for _ in range(count):
        _, pos = _read_uvarint(buf, pos)
        size, pos = _read_uvarint(buf, pos)
        pos += size
    return pos


def scram_mechanisms(
    host: str, port: int, user: str, *, ssl_context: ssl.SSLContext | None = None
) -> set[str]:
    """The SCRAM mechanisms the broker at host:port holds credentials for, for user (empty if none)."""
    client_id = b"kafka_broker.py"
    name = user.encode()
    header = struct.pack(">hhih", 50, 0, 1, len(client_id)) + client_id + b"\x00"
    body = _uvarint(2) + _uvarint(len(name) + 1) + name + b"\x00" + b"\x00"
    with _connect(host, port, 5.0, ssl_context) as sock:
        payload = header + body
        sock.sendall(struct.pack(">i", len(payload)) + payload)
        resp = _recv_exact(sock, struct.unpack(">i", _recv_exact(sock, 4))[0])
    pos = _skip_tags(resp, 4)  # correlation id, header tags
    pos += 4  # throttle_time_ms
    (error,) = struct.unpack_from(">h", resp, pos)
    _, pos = _read_compact_string(resp, pos + 2)
    if error:
        raise ConnectionError(f"DescribeUserScramCredentials error {error}")
    found: set[str] = set()
    results, pos = _read_uvarint(resp, pos)
    for _ in range(max(results - 1, 0)):
        got_user, pos = _read_compact_string(resp, pos)
        (error,) = struct.unpack_from(">h", resp, pos)
        _, pos = _read_compact_string(resp, pos + 2)
        infos, pos = _read_uvarint(resp, pos)
        for _ in range(max(infos - 1, 0)):
            mechanism = resp[pos]
            pos = _skip_tags(resp, pos + 5)  # mechanism int8, iterations int32
            if got_user == user and error == 0 and mechanism in _SCRAM_MECHANISMS:
                found.add(_SCRAM_MECHANISMS[mechanism])
        pos = _skip_tags(resp, pos)
    return found


def _write_private(path: Path, text: str) -> Path:
    """Write text to a file only its owner can read (secrets go to files, never to argv)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    path.chmod(0o600)
    return path


def _argfile_line(arg: str) -> str:
    """One argument, quoted for a java launcher @argfile."""
    if "\n" in arg or "\r" in arg:
        raise KafkaBrokerError("an argument for a java @argfile cannot span lines")
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"\n'


_SECRET_UNSAFE = re.compile(r'[\s,\[\]"\\=;]')


def _check_secret(secret: str) -> str:
    """Kafka's SCRAM/JAAS config syntaxes have no quoting: refuse what would break them."""
    if not secret or _SECRET_UNSAFE.search(secret):
        raise KafkaBrokerError('password must be non-empty without whitespace or any of ,[]"\\=;')
    return secret


SECURED_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN", "OAUTHBEARER")
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
OAUTH_LOGIN = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"


class KafkaBroker:
    """One KRaft broker+controller process on loopback, with its own temp data dir.

    ``secured=True``: listeners SASL_SSL (``port``), SSL with required client certs (``ssl_port``) and
    CONTROLLER over mTLS; inter-broker traffic on SSL as ``User:broker``. See the module docstring.
    """

    def __init__(self, *, keep: bool = False, startup_timeout: float = 90.0, secured: bool = False) -> None:
        self.keep = keep
        self.startup_timeout = startup_timeout
        self.secured = secured
        self.work_dir: Path | None = None
        self.port = 0
        self.controller_port = 0
        self.ssl_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = 0.0
        self.tls: TlsMaterial | None = None
        self.admin_user = "admin"
        self.admin_password = secrets.token_urlsafe(18) if secured else ""
        self.plain_users: dict[str, str] = (
            {self.admin_user: self.admin_password, "plainuser": secrets.token_urlsafe(18)} if secured else {}
        )
        self.super_users = (f"User:{self.admin_user}", "User:broker")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._work() / "logs" / "server.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _work(self) -> Path:
        if self.work_dir is None:
            raise KafkaBrokerError("broker was never started")
        return self.work_dir

    # --- secured mode ----------------------------------------------------------------------------------

    def _tls(self) -> TlsMaterial:
        if not self.secured:
            raise KafkaBrokerError("not a secured broker (KafkaBroker(secured=True))")
        if self.tls is None:
            raise KafkaBrokerError("broker was never started")
        return self.tls

    @property
    def sasl_ssl_bootstrap(self) -> str:
        self._tls()
        return f"127.0.0.1:{self.port}"

    @property
    def ssl_bootstrap(self) -> str:
        self._tls()
        return f"127.0.0.1:{self.ssl_port}"

    @property
    def tls_dir(self) -> Path:
        return self._tls().directory

    @property
    def ca_file(self) -> Path:
        return self._tls().ca_file

    @property
    def foreign_ca_file(self) -> Path:
        return self._tls().foreign_ca_file

    @property
    def admin_client_config(self) -> Path:
        """Java client properties (0600) that authenticate as the admin over SASL_SSL SCRAM-SHA-512."""
        self._tls()
        return self._work() / "admin-client.properties"

    def client_cert(self, cn: str, *, expired: bool = False) -> tuple[Path, Path]:
        """A client certificate and key for ``CN=<cn>`` (principal ``User:<cn>`` on the SSL listener)."""
        return self._tls().client_cert(cn, expired=expired)

    def _broker_ssl_context(self) -> ssl.SSLContext:
        """Python TLS as the broker's own identity (a super user): for readiness and metadata checks."""
        tls = self._tls()
        context = ssl.create_default_context(cafile=str(tls.ca_file))
        context.load_cert_chain(str(tls.broker_cert), str(tls.broker_key))
        return context

    def kafka_acls(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run kafka-acls (AclCommand) as the admin over SASL_SSL; raise with its stderr if it fails."""
        cmd = [
            "--bootstrap-server",
            self.sasl_ssl_bootstrap,
            "--command-config",
            str(self.admin_client_config),
        ]
        return self._tool(ACL_MAIN, [*cmd, *args])

    def add_scram_user(self, name: str, password: str, mechanism: str = "SCRAM-SHA-512") -> None:
        """Create (or reset) a SCRAM user via kafka-configs and wait until the broker serves it."""
        if mechanism not in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            raise KafkaBrokerError(f"unknown SCRAM mechanism {mechanism!r}")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise KafkaBrokerError(f"SCRAM user name must match [A-Za-z0-9._-]+: {name!r}")
        config = f"{mechanism}=[iterations=4096,password={_check_secret(password)}]"
        self._tool(
            CONFIG_MAIN,
            [
                "--bootstrap-server", self.sasl_ssl_bootstrap,
                "--command-config", str(self.admin_client_config),
                "--alter", "--entity-type", "users", "--entity-name", name, "--add-config", config,
            ],
            mask=(password,),
        )  # fmt: skip
        context = self._broker_ssl_context()
        deadline = time.monotonic() + 30
        while True:
            try:
                if mechanism in scram_mechanisms("127.0.0.1", self.ssl_port, name, ssl_context=context):
                    return
            except (OSError, struct.error, IndexError):
                pass
            if time.monotonic() > deadline:
                raise KafkaBrokerError(
                    f"broker does not list the {mechanism} credential of {name!r} after 30s"
                )
            time.sleep(0.1)

    def _tool(
        self, main: str, args: list[str], *, mask: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """A Kafka CLI tool on the broker's classpath. Main class and arguments go through a 0600 java
        @argfile, so nothing passed here shows in any process's argv; secrets are masked in errors."""
        work = self._work()
        argfile = work / f"tool-{uuid.uuid4().hex}.args"
        _write_private(argfile, "".join(_argfile_line(a) for a in (main, *args)))
        cmd = self._java(f"@{argfile}", logs_dir=work / "tool-logs", jvm_opts=TOOL_JVM_OPTS)
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        finally:
            argfile.unlink(missing_ok=True)
        if result.returncode != 0:
            err, out = result.stderr, result.stdout
            for secret in mask:
                err, out = err.replace(secret, "***"), out.replace(secret, "***")
            name = main.rsplit(".", 1)[-1]
            raise KafkaBrokerError(
                f"{name} failed ({result.returncode}):\n{err.strip()}\n{out.strip()[-2000:]}"
            )
        return result

    def _secured_properties(self) -> dict[str, str]:
        tls = self._tls()
        mechanisms = ",".join(SECURED_MECHANISMS)
        plain_users = " ".join(f'user_{name}="{_check_secret(pw)}"' for name, pw in self.plain_users.items())
        sasl = "listener.name.sasl_ssl"
        return {
            "listeners": (
                f"SASL_SSL://127.0.0.1:{self.port},SSL://127.0.0.1:{self.ssl_port},"
                f"CONTROLLER://127.0.0.1:{self.controller_port}"
            ),
            "advertised.listeners": f"SASL_SSL://127.0.0.1:{self.port},SSL://127.0.0.1:{self.ssl_port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,SSL:SSL,CONTROLLER:SSL",
            "inter.broker.listener.name": "SSL",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(tls.broker_keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(tls.ca_file),
            "ssl.endpoint.identification.algorithm": "https",
            "ssl.principal.mapping.rules": "RULE:^CN=(.*?)$/$1/,DEFAULT",
            "listener.name.ssl.ssl.client.auth": "required",
            "listener.name.controller.ssl.client.auth": "required",
            f"{sasl}.ssl.client.auth": "none",
            "sasl.enabled.mechanisms": mechanisms,
            f"{sasl}.sasl.enabled.mechanisms": mechanisms,
            f"{sasl}.scram-sha-256.sasl.jaas.config": f"{SCRAM_LOGIN} required;",
            f"{sasl}.scram-sha-512.sasl.jaas.config": f"{SCRAM_LOGIN} required;",
            f"{sasl}.plain.sasl.jaas.config": f"{PLAIN_LOGIN} required {plain_users};",
            # no server callback handler: Kafka's unsecured JWT validator (alg "none", principal = "sub")
            f"{sasl}.oauthbearer.sasl.jaas.config": (
                f'{OAUTH_LOGIN} required unsecuredLoginStringClaim_sub="broker";'
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": ";".join(self.super_users),
        }

    def _admin_client_properties(self) -> str:
        jaas = f'{SCRAM_LOGIN} required username="{self.admin_user}" password="{self.admin_password}";'
        props = {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": jaas,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca_file),
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _properties(self) -> str:
        work = self._work()
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(work / "data"),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.cleaner.enable": "true",
            "log.cleaner.threads": "1",
            "log.cleaner.backoff.ms": "1000",
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        }
        if self.secured:
            props.update(self._secured_properties())
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(
        self,
        main: str,
        *args: str,
        logs_dir: Path | None = None,
        jvm_opts: tuple[str, ...] = DEFAULT_JVM_OPTS,
    ) -> list[str]:
        cache = prepare()
        opts = os.environ.get("SANDBOX_LANES_KAFKA_JVM_OPTS", "").split() or list(jvm_opts)
        return [
            "java", *opts,
            f"-Dlog4j2.configurationFile={cache / 'log4j2.xml'}",
            f"-Dkafka.logs.dir={logs_dir or self._work() / 'logs'}",
            "-cp", str(cache / "lib" / "*"), main, *args,
        ]  # fmt: skip

    def start(self) -> None:
        """Format a fresh data dir (first start only), launch the broker and wait until it serves."""
        if self.proc is not None:
            raise KafkaBrokerError("broker already running")
        began = time.monotonic()
        prepare()
        fresh = self.work_dir is None
        if fresh:
            self.work_dir = Path(tempfile.mkdtemp(prefix="sandbox-lanes-kafka-"))
            self.port, self.controller_port = _free_port(), _free_port()
            if self.secured:
                self.ssl_port = _free_port()
        work = self._work()
        props = work / "server.properties"
        if fresh:
            if self.secured:
                self._prepare_secured(work, props)
            else:
                props.write_text(self._properties())
                fmt = self._java(STORAGE_TOOL_MAIN, "format", "-t", _cluster_id(), "-c", str(props))
                result = subprocess.run(fmt, capture_output=True, text=True, timeout=120, check=False)
                if result.returncode != 0:
                    self.stop(remove=True)
                    tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
                    raise KafkaBrokerError(f"kafka storage format failed ({result.returncode}):\n{tail}")
        console = work / "console.log"
        with console.open("ab") as out:
            self.proc = subprocess.Popen(
                self._java(BROKER_MAIN, str(props)),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self._wait_ready()
        self.startup_seconds = time.monotonic() - began

    def _prepare_secured(self, work: Path, props: Path) -> None:
        """TLS material, 0600 server/admin properties, and the format with the admin's SCRAM credential."""
        try:
            self.tls = generate_tls(work / "tls")
            _write_private(props, self._properties())
            _write_private(self.admin_client_config, self._admin_client_properties())
            scram = f"SCRAM-SHA-512=[name={self.admin_user},password={_check_secret(self.admin_password)}]"
            args = ["format", "-t", _cluster_id(), "-c", str(props), "--add-scram", scram]
            self._tool(STORAGE_TOOL_MAIN, args, mask=(self.admin_password,))
        except Exception as exc:
            self.stop(remove=True)
            raise KafkaBrokerError(f"secured broker setup failed: {exc}") from exc

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | str = "no answer yet"
        context = self._broker_ssl_context() if self.secured else None
        port = self.ssl_port if self.secured else self.port
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"broker exited with code {self.proc.returncode} during startup")
            try:
                if alive_brokers("127.0.0.1", port, ssl_context=context) >= 1:
                    return
                last = "metadata lists no alive broker yet"
            except (OSError, struct.error) as exc:
                last = exc
            time.sleep(0.2)
        self._fail(f"broker not ready on {self.bootstrap} after {self.startup_timeout:g}s ({last})")

    def _fail(self, reason: str) -> None:
        work = self._work()
        server, console = _tail(self.log_path), _tail(work / "console.log")
        tails = f"--- server.log ---\n{server}\n--- console.log ---\n{console}"
        keep, self.keep = self.keep, True
        self.stop()
        self.keep = keep
        raise KafkaBrokerError(f"{reason}; logs kept in {work}\n{tails}")

    def stop(self, *, remove: bool | None = None) -> None:
        """SIGTERM, then SIGKILL after a grace period; remove the temp dir unless keeping it."""
        if self.proc is not None:
            _terminate(self.proc.pid, lambda: self.proc is not None and self.proc.poll() is not None)
            self.proc.wait()
            self.proc = None
        if remove is None:
            remove = not self.keep
        if remove and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None
            self.tls = None

    def restart(self) -> None:
        """Stop and start again on the same ports and the same data dir."""
        self.stop(remove=False)
        self.start()

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(pid: int, exited: Callable[[], bool] | None = None, grace: float = 30.0) -> None:
    def gone() -> bool:
        if exited is not None:
            return exited()
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if gone():
                return
            time.sleep(0.1)


# --- CLI ---------------------------------------------------------------------------------------------


def _state_file() -> Path:
    return cache_dir() / "broker-state.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kafka_broker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="fetch Kafka into the cache")
    start = sub.add_parser("start", help="start a broker in the background")
    start.add_argument("--timeout", type=float, default=90.0)
    sub.add_parser("stop", help="stop the broker started by 'start'")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "prepare":
            print(prepare())
        elif args.cmd == "start":
            return _cli_start(args.timeout)
        else:
            return _cli_stop()
    except KafkaBrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cli_start(timeout: float) -> int:
    state = _state_file()
    if state.is_file():
        print(f"error: a broker seems to be running ({state}); run 'stop' first", file=sys.stderr)
        return 1
    broker = KafkaBroker(startup_timeout=timeout)
    broker.start()
    info = {"bootstrap": broker.bootstrap, "pid": broker.pid, "work_dir": str(broker.work_dir)}
    state.write_text(json.dumps(info))
    print(f"bootstrap={broker.bootstrap}\npid={broker.pid}\nlog={broker.log_path}")
    broker.proc = None  # leave it running after this process exits
    return 0


def _cli_stop() -> int:
    state = _state_file()
    if not state.is_file():
        print("no broker state file; nothing to stop", file=sys.stderr)
        return 0
    info = json.loads(state.read_text())
    _terminate(int(info["pid"]))
    shutil.rmtree(info["work_dir"], ignore_errors=True)
    state.unlink()
    print(f"stopped pid={info['pid']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
