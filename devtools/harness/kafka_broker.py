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


# --- a multi-node KRaft cluster ---------------------------------------------------------------------

#: A cluster node's JVM: a 512 MiB heap at most (three of them, beside the single broker, fit a CI box).
CLUSTER_JVM_OPTS = (
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)
TOPIC_MAIN = "org.apache.kafka.tools.TopicCommand"  # kafka-topics.sh
#: FindCoordinator key types.
GROUP_KEY, TRANSACTION_KEY = 0, 1
#: Errors a FindCoordinator answers while the coordinator moves or loads: ask again.
_COORDINATOR_RETRIABLE = {14: "COORDINATOR_LOAD_IN_PROGRESS", 15: "COORDINATOR_NOT_AVAILABLE"}


class _Reader:
    """A cursor over a non-flexible Kafka response body."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def _unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def int8(self) -> int:
        return self._unpack(">b")

    def int16(self) -> int:
        return self._unpack(">h")

    def int32(self) -> int:
        return self._unpack(">i")

    def string(self) -> str | None:
        size = self.int16()
        if size < 0:
            return None
        text = self.buf[self.pos : self.pos + size].decode()
        self.pos += size
        return text

    def int32s(self) -> tuple[int, ...]:
        return tuple(self.int32() for _ in range(max(self.int32(), 0)))


def _api_versions(sock: socket.socket) -> dict[int, tuple[int, int]]:
    resp = _roundtrip(sock, 18, 0, b"")  # ApiVersions v0
    error, count = struct.unpack_from(">hi", resp, 0)
    if error:
        raise ConnectionError(f"ApiVersions error {error}")
    ranges = {}
    for i in range(count):
        key, lo, hi = struct.unpack_from(">hhh", resp, 6 + 6 * i)
        ranges[key] = (lo, hi)
    return ranges


def _kstring(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


class PartitionInfo:
    """One partition as a broker's Metadata answer describes it."""

    __slots__ = ("error", "internal", "isr", "leader", "offline", "partition", "replicas", "topic")

    def __init__(
        self,
        topic: str,
        partition: int,
        error: int,
        leader: int,
        replicas: tuple[int, ...],
        isr: tuple[int, ...],
        offline: tuple[int, ...],
        internal: bool,
    ) -> None:
        self.topic, self.partition, self.error, self.leader = topic, partition, error, leader
        self.replicas, self.isr, self.offline, self.internal = replicas, isr, offline, internal

    @property
    def under_replicated(self) -> bool:
        return self.leader < 0 or len(self.isr) < len(self.replicas) or bool(self.offline)

    def __repr__(self) -> str:
        return (
            f"{self.topic}-{self.partition}(leader={self.leader}, replicas={list(self.replicas)}, "
            f"isr={list(self.isr)}" + (f", offline={list(self.offline)}" if self.offline else "") + ")"
        )


def cluster_metadata(host: str, port: int, timeout: float = 3.0) -> tuple[set[int], list[PartitionInfo]]:
    """The unfenced broker ids and every partition (internal topics included) as the broker at
    host:port reports them in a Metadata v8 answer (non-flexible)."""
    with _connect(host, port, timeout, None) as sock:
        ranges = _api_versions(sock)
        lo, hi = ranges.get(3, (0, -1))
        if not lo <= 8 <= hi:
            raise ConnectionError(f"Metadata v8 not in the broker's {lo}..{hi}")
        body = struct.pack(">i", -1) + b"\x00" + b"\x00\x00"  # all topics, no auto-create, no ACL ops
        resp = _Reader(_roundtrip(sock, 3, 8, body))
    resp.int32()  # throttle_time_ms
    brokers: set[int] = set()
    for _ in range(resp.int32()):
        brokers.add(resp.int32())
        resp.string()  # host
        resp.int32()  # port
        resp.string()  # rack
    resp.string()  # cluster id
    resp.int32()  # controller id
    partitions: list[PartitionInfo] = []
    for _ in range(resp.int32()):
        topic_error = resp.int16()
        name = resp.string() or ""
        internal = resp.int8() != 0
        for _ in range(resp.int32()):
            error, index, leader = resp.int16(), resp.int32(), resp.int32()
            resp.int32()  # leader epoch
            replicas, isr, offline = resp.int32s(), resp.int32s(), resp.int32s()
            partitions.append(
                PartitionInfo(name, index, error or topic_error, leader, replicas, isr, offline, internal)
            )
        resp.int32()  # topic authorized operations
    return brokers, partitions


def find_coordinator(host: str, port: int, key: str, key_type: int, timeout: float = 3.0) -> int:
    """The node id of the coordinator of a group (``GROUP_KEY``) or transactional id
    (``TRANSACTION_KEY``), as the broker at host:port answers FindCoordinator v1/v2 (non-flexible).
    Raises ``ConnectionError`` while there is none (moving, loading, its topic being created)."""
    with _connect(host, port, timeout, None) as sock:
        lo, hi = _api_versions(sock).get(10, (0, -1))
        version = max(lo, 1)
        if version > min(hi, 2):
            raise ConnectionError(f"no FindCoordinator v1/v2 in the broker's {lo}..{hi}")
        resp = _Reader(_roundtrip(sock, 10, version, _kstring(key) + struct.pack(">b", key_type)))
    resp.int32()  # throttle_time_ms
    error = resp.int16()
    message = resp.string()
    node_id = resp.int32()
    if error:
        name = _COORDINATOR_RETRIABLE.get(error, f"error {error}")
        raise ConnectionError(f"FindCoordinator({key!r}): {name} {message or ''}".strip())
    return node_id


def java_string_hash(text: str) -> int:
    """Java's ``String.hashCode()`` (UTF-16 code units), as a signed 32-bit int."""
    h = 0
    raw = text.encode("utf-16-be")
    for i in range(0, len(raw), 2):
        h = (31 * h + int.from_bytes(raw[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of ``__consumer_offsets`` / ``__transaction_state`` that holds ``key``
    (Kafka's ``Utils.abs(key.hashCode()) % partitions``; its abs maps Integer.MIN_VALUE to 0): its
    leader is the coordinator."""
    h = java_string_hash(key)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class ClusterNode(KafkaBroker):
    """One combined broker+controller node of a :class:`KafkaCluster` (started and stopped by it)."""

    def __init__(self, cluster: KafkaCluster, index: int) -> None:
        super().__init__(keep=True, startup_timeout=cluster.startup_timeout)
        self.cluster = cluster
        self.index = index
        self.node_id = index + 1
        #: With ``KafkaCluster(proxied=True)``: the PROXIED listener's own port, and the port it
        #: advertises (a fault proxy's, between clients and this listener). 0 otherwise.
        self.proxied_port = 0
        self.proxy_port = 0

    def _properties(self) -> str:
        return self.cluster._node_properties(self)

    def start(self) -> None:
        raise KafkaBrokerError("a cluster node is started by its KafkaCluster (start_node)")

    def launch(self) -> None:
        """Start the node's JVM on its formatted data dir; does not wait (a quorum needs its peers)."""
        if self.proc is not None and self.proc.poll() is None:
            raise KafkaBrokerError(f"node {self.index} already running")
        work = self._work()
        with (work / "console.log").open("ab") as out:
            self.proc = subprocess.Popen(
                self._java(BROKER_MAIN, str(work / "server.properties"), jvm_opts=CLUSTER_JVM_OPTS),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """Resident memory of the node's JVM (0 when it is not running)."""
        if not self.running:
            return 0
        assert self.proc is not None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0


class KafkaCluster:
    """A KRaft cluster of ``nodes`` combined broker+controller processes on loopback (node ids 1..n,
    every node a voter of the metadata quorum), replication ``nodes`` (at most 3) with
    ``min.insync.replicas`` one less, for broker-fault tests: :meth:`kill` (SIGKILL), :meth:`stop_node`
    (SIGTERM) and :meth:`start_node` a node by index, :meth:`wait_isr_full`, and the group and transaction
    coordinators by id (:meth:`group_coordinator`, :meth:`transaction_coordinator`).

    With ``proxied=True`` each node also has a ``PROXIED`` listener (``ClusterNode.proxied_port``)
    that advertises another loopback port (``ClusterNode.proxy_port``), where a fault proxy
    (``harness.toxiproxy``) forwards to it: a client bootstrapped on :attr:`proxied_bootstrap` then
    reaches every broker through its proxy, while the inter-broker and controller listeners (and
    :attr:`bootstrap`) stay direct, so the cluster stays healthy while the proxied links are faulted.
    """

    def __init__(
        self,
        nodes: int = 3,
        *,
        keep: bool = False,
        startup_timeout: float = 120.0,
        internal_partitions: int = 12,
        proxied: bool = False,
    ) -> None:
        if nodes < 1:
            raise KafkaBrokerError("a cluster needs at least one node")
        self.keep = keep
        self.startup_timeout = startup_timeout
        self.internal_partitions = internal_partitions
        self.proxied = proxied
        self.replication = min(nodes, 3)
        self.min_isr = max(1, self.replication - 1)
        self.work_dir: Path | None = None
        self.nodes = [ClusterNode(self, i) for i in range(nodes)]
        self.startup_seconds = 0.0

    # --- addresses --------------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Every node's listener: a client reaches the cluster whichever node is down."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def proxied_bootstrap(self) -> str:
        """Every node's proxy address (``proxied=True`` only): whatever a client asks, it goes
        through the proxies, because each node advertises its proxy on that listener."""
        if not self.proxied:
            raise KafkaBrokerError("the cluster was not started with proxied=True")
        return ",".join(f"127.0.0.1:{node.proxy_port}" for node in self.nodes)

    def index_of(self, node_id: int) -> int:
        for node in self.nodes:
            if node.node_id == node_id:
                return node.index
        raise KafkaBrokerError(f"no node with id {node_id}")

    def _live(self, exclude: int | None = None) -> list[ClusterNode]:
        return [n for n in self.nodes if n.running and n.index != exclude]

    def _node_properties(self, node: ClusterNode) -> str:
        work = node._work()
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        listeners = f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        advertised = f"PLAINTEXT://127.0.0.1:{node.port}"
        protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
        if self.proxied:
            listeners += f",PROXIED://127.0.0.1:{node.proxied_port}"
            advertised += f",PROXIED://127.0.0.1:{node.proxy_port}"
            protocols += ",PROXIED:PLAINTEXT"
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listeners": listeners,
            "advertised.listeners": advertised,
            "listener.security.protocol.map": protocols,
            "log.dirs": str(work / "data"),
            "num.partitions": "1",
            "default.replication.factor": str(self.replication),
            "min.insync.replicas": str(self.min_isr),
            "offsets.topic.replication.factor": str(self.replication),
            "offsets.topic.num.partitions": str(self.internal_partitions),
            "transaction.state.log.replication.factor": str(self.replication),
            "transaction.state.log.min.isr": str(self.min_isr),
            "transaction.state.log.num.partitions": str(self.internal_partitions),
            "share.coordinator.state.topic.replication.factor": str(self.replication),
            "share.coordinator.state.topic.min.isr": str(self.min_isr),
            "unclean.leader.election.enable": "false",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.cleaner.enable": "true",
            "log.cleaner.threads": "1",
            "log.cleaner.backoff.ms": "1000",
            "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Format every node's data dir with one cluster id, start them all, wait until each one
        serves with every broker unfenced, create the internal topics (offsets, transactions) and
        wait until every partition's ISR is full."""
        if self.work_dir is not None:
            raise KafkaBrokerError("cluster already started")
        began = time.monotonic()
        prepare()
        self.work_dir = Path(tempfile.mkdtemp(prefix="sandbox-lanes-kafka-cluster-"))
        try:
            for node in self.nodes:
                node.work_dir = self.work_dir / f"node-{node.node_id}"
                node.work_dir.mkdir()
                node.port, node.controller_port = _free_port(), _free_port()
                if self.proxied:
                    node.proxied_port, node.proxy_port = _free_port(), _free_port()
            cluster_id = _cluster_id()
            formats = []
            for node in self.nodes:
                props = node._work() / "server.properties"
                props.write_text(node._properties())
                cmd = node._java(STORAGE_TOOL_MAIN, "format", "-t", cluster_id, "-c", str(props))
                formats.append(
                    (node, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
                )
            for node, proc in formats:
                out, _ = proc.communicate(timeout=120)
                if proc.returncode != 0:
                    tail = "\n".join(out.decode(errors="replace").splitlines()[-40:])
                    raise KafkaBrokerError(f"format of node {node.index} failed ({proc.returncode}):\n{tail}")
            for node in self.nodes:
                node.launch()
            deadline = began + self.startup_timeout
            for node in self.nodes:
                self._wait_serving(node, deadline)
            self._wait_coordinators(deadline)
            self.wait_isr_full(max(5.0, deadline - time.monotonic()), confirm=False)
        except BaseException as exc:
            tails = self._tails()
            keep, self.keep = self.keep, True
            self.stop()
            self.keep = keep
            if isinstance(exc, KafkaBrokerError):
                raise KafkaBrokerError(f"{exc}\n{tails}") from exc
            raise
        self.startup_seconds = time.monotonic() - began

    def _tails(self) -> str:
        parts = []
        for node in self.nodes:
            if node.work_dir is not None:
                parts.append(f"--- node {node.index} server.log ---\n{_tail(node.log_path, 20)}")
                parts.append(
                    f"--- node {node.index} console.log ---\n{_tail(node.work_dir / 'console.log', 10)}"
                )
        return "\n".join(parts) + (f"\nlogs kept in {self.work_dir}" if self.work_dir else "")

    def _wait_serving(self, node: ClusterNode, deadline: float) -> None:
        """Until ``node`` answers Metadata listing every node as an unfenced broker."""
        last: Exception | str = "no answer yet"
        want = {n.node_id for n in self.nodes}
        while time.monotonic() < deadline:
            if not node.running:
                assert node.proc is not None
                raise KafkaBrokerError(f"node {node.index} exited with code {node.proc.returncode}")
            try:
                brokers, _ = cluster_metadata("127.0.0.1", node.port)
                if brokers >= want:
                    return
                last = f"unfenced brokers {sorted(brokers)}"
            except (OSError, struct.error, UnicodeDecodeError) as exc:
                last = exc
            time.sleep(0.2)
        raise KafkaBrokerError(f"node {node.index} not serving on {node.bootstrap} in time ({last})")

    def _wait_coordinators(self, deadline: float) -> None:
        """Ask for a group and a transaction coordinator until both exist: the broker creates
        ``__consumer_offsets`` and ``__transaction_state`` on the first such question."""
        for key_type in (GROUP_KEY, TRANSACTION_KEY):
            self._coordinator("sandbox-lanes-cluster-warmup", key_type, max(1.0, deadline - time.monotonic()))

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (no controlled shutdown) and reap it."""
        node = self.nodes[index]
        if not node.running:
            raise KafkaBrokerError(f"node {index} is not running")
        assert node.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(30)

    def stop_node(self, index: int, timeout: float = 60.0) -> float:
        """SIGTERM node ``index`` (a controlled shutdown: the controller moves its leaders and
        coordinators first, as in a rolling restart) and wait until it exited; SIGKILL past
        ``timeout``. Returns the seconds it took."""
        node = self.nodes[index]
        if not node.running:
            raise KafkaBrokerError(f"node {index} is not running")
        assert node.proc is not None
        began = time.monotonic()
        node.proc.terminate()
        try:
            node.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(30)
            raise KafkaBrokerError(f"node {index} ignored SIGTERM for {timeout:g}s: killed") from None
        return time.monotonic() - began

    def start_node(self, index: int, timeout: float = 90.0) -> float:
        """Start node ``index`` again on its data dir and ports; wait until it serves with every
        broker unfenced. Returns the seconds it took."""
        began = time.monotonic()
        node = self.nodes[index]
        node.launch()
        self._wait_serving(node, began + timeout)
        return time.monotonic() - began

    def wait_fenced(self, index: int, timeout: float = 60.0) -> float:
        """Until the live nodes no longer list node ``index`` as a broker and no partition is led by
        it (the controller fenced it and moved its leaders). Returns the seconds it took."""
        began = time.monotonic()
        node_id = self.nodes[index].node_id
        last = "no answer yet"
        while time.monotonic() - began < timeout:
            try:
                views = [cluster_metadata("127.0.0.1", n.port) for n in self._live(exclude=index)]
                led = [p for _, parts in views for p in parts if p.leader == node_id]
                listed = [sorted(b) for b, _ in views if node_id in b]
                if views and not led and not listed:
                    return time.monotonic() - began
                last = f"still listed by {len(listed)} node(s), leading {len(led)} partition(s)"
            except (OSError, struct.error, UnicodeDecodeError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise KafkaBrokerError(f"node {index} not fenced after {timeout:g}s: {last}")

    def under_replicated(self) -> list[PartitionInfo]:
        """Partitions whose ISR is not every replica (or that have no leader), as any live node sees
        them (each node's metadata is asked; one lagging view counts)."""
        found: dict[tuple[str, int], PartitionInfo] = {}
        live = self._live()
        if not live:
            raise KafkaBrokerError("no node is running")
        for node in live:
            brokers, parts = cluster_metadata("127.0.0.1", node.port)
            if brokers != {n.node_id for n in live}:
                raise ConnectionError(f"node {node.index} lists brokers {sorted(brokers)}")
            for p in parts:
                if p.under_replicated:
                    found.setdefault((p.topic, p.partition), p)
        return list(found.values())

    def under_replicated_by_tool(self) -> list[str]:
        """``kafka-topics.sh --describe --under-replicated-partitions`` (TopicCommand): the lines it
        prints, one per partition whose ISR is short (empty: none)."""
        live = self._live()
        if not live:
            raise KafkaBrokerError("no node is running")
        args = ["--bootstrap-server", ",".join(n.bootstrap for n in live), "--describe"]
        result = live[0]._tool(TOPIC_MAIN, [*args, "--under-replicated-partitions"])
        unavailable = live[0]._tool(TOPIC_MAIN, [*args, "--unavailable-partitions"])
        lines = (result.stdout + unavailable.stdout).splitlines()
        return [line.strip() for line in lines if line.strip()]

    def wait_isr_full(self, timeout: float = 120.0, *, confirm: bool = True) -> float:
        """Until every partition (internal topics included) has its whole replica set in its ISR on
        every live node's metadata; with ``confirm``, then until the broker's own TopicCommand lists no
        under-replicated or unavailable partition. Returns the seconds it took."""
        began = time.monotonic()
        last: object = "no answer yet"
        while time.monotonic() - began < timeout:
            try:
                short = self.under_replicated()
                if not short:
                    if not confirm:
                        return time.monotonic() - began
                    lines = self.under_replicated_by_tool()
                    if not lines:
                        return time.monotonic() - began
                    last = f"TopicCommand: {lines[:5]}"
                else:
                    last = short[:5]
            except (OSError, struct.error, UnicodeDecodeError, KafkaBrokerError) as exc:
                last = exc
            time.sleep(0.3)
        raise KafkaBrokerError(f"ISR not full after {timeout:g}s: {last}")

    def _coordinator(self, key: str, key_type: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        last: Exception | str = "no node running"
        while True:
            for node in self._live():
                try:
                    return self.index_of(find_coordinator("127.0.0.1", node.port, key, key_type))
                except (OSError, struct.error, UnicodeDecodeError) as exc:
                    last = exc
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"no coordinator for {key!r} after {timeout:g}s: {last}")
            time.sleep(0.2)

    def group_coordinator(self, group_id: str, timeout: float = 30.0) -> int:
        """Index of the node that is the consumer group's coordinator now (FindCoordinator)."""
        return self._coordinator(group_id, GROUP_KEY, timeout)

    def transaction_coordinator(self, transactional_id: str, timeout: float = 30.0) -> int:
        """Index of the node that is the transactional id's coordinator now (FindCoordinator)."""
        return self._coordinator(transactional_id, TRANSACTION_KEY, timeout)

    def rss_bytes(self) -> list[int]:
        """Resident memory of each node's JVM (0 for a node that is down)."""
        return [node.rss_bytes() for node in self.nodes]

    def stop(self) -> None:
        """SIGTERM every node at once, SIGKILL what is left after a grace period; remove the data
        unless keeping it."""
        for node in self.nodes:
            if node.running:
                assert node.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.proc.pid, signal.SIGKILL)
                node.proc.wait(10)
            node.proc = None
        if not self.keep and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None
            for node in self.nodes:
                node.work_dir = None

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
