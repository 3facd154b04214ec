"""A real single-node Apache Kafka (KRaft) broker for tests and local scripts.

Stdlib only. ``prepare`` fetches Kafka and its runtime dependencies from Maven Central into a cache
outside the repo; ``KafkaBroker`` formats a fresh KRaft data dir, runs ``kafka.Kafka`` on free
loopback ports and waits until the broker is registered and unfenced.

CLI::

    python -m harness.kafka_broker prepare
    python -m harness.kafka_broker start   # prints bootstrap + pid, writes a state file
    python -m harness.kafka_broker stop
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from harness.cache import cache_root, locked

KAFKA_VERSION = "4.4.0"
LOG4J_VERSION = "2.25.5"  # matches the log4j-core that kafka_2.13 4.4.0 depends on
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"
BROKER_MAIN = "kafka.Kafka"
DEFAULT_JVM_OPTS = (
    "-Xms256m",
    "-Xmx1g",
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


def alive_brokers(host: str, port: int, timeout: float = 2.0) -> int:
    """Number of unfenced brokers the broker at host:port reports in a Metadata response."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
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


class KafkaBroker:
    """One KRaft broker+controller process on loopback, with its own temp data dir."""

    def __init__(self, *, keep: bool = False, startup_timeout: float = 90.0) -> None:
        self.keep = keep
        self.startup_timeout = startup_timeout
        self.work_dir: Path | None = None
        self.port = 0
        self.controller_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = 0.0

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
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, main: str, *args: str) -> list[str]:
        cache = prepare()
        opts = os.environ.get("SANDBOX_LANES_KAFKA_JVM_OPTS", "").split() or list(DEFAULT_JVM_OPTS)
        return [
            "java", *opts,
            f"-Dlog4j2.configurationFile={cache / 'log4j2.xml'}",
            f"-Dkafka.logs.dir={self._work() / 'logs'}",
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
        work = self._work()
        props = work / "server.properties"
        if fresh:
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

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | str = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"broker exited with code {self.proc.returncode} during startup")
            try:
                if alive_brokers("127.0.0.1", self.port) >= 1:
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
