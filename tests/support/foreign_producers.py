"""Producers that are not Python, as the pod meets them in production: Kafka's own Java client (4.4.0,
from the harness's classpath) and librdkafka (the C client under confluent-kafka, as Go, .NET and
many other clients are), each with a ``compression.type``. And what the broker stored: the codec of
every record batch, read from the partition's log segments.
"""

from __future__ import annotations

import functools
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaError, Message, Producer
from google.protobuf.message import Message as Event
from harness.kafka_broker import TOOL_JVM_OPTS, prepare

from consumers.runtime.kafka.topology import Topics
from consumers.tools.topic_io import topic_for
from events.codec import encode

#: A batch's codec, by the low three bits of its attributes (Kafka's record format v2).
CODEC_NAMES = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
_JAVA_SOURCE = Path(__file__).resolve().parent / "java" / "RecordFileProducer.java"
_compile_lock = threading.Lock()


@dataclass(frozen=True)
class RawRecord:
    """One record as a producer writes it, and the codec its producer compresses with."""

    compression: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


def event_records(compression: str, topics: Topics, events: Iterable[Event]) -> list[RawRecord]:
    """Input events encoded as the upstream producer encodes them (``events.codec.encode``)."""
    out = []
    for event in events:
        record = encode(event, source="foreign-producer")
        out.append(
            RawRecord(compression, topic_for(event, topics), record.key, record.value, tuple(record.headers))
        )
    return out


# --- Kafka's Java producer ------------------------------------------------------------------------


def _lib() -> Path:
    return prepare() / "lib"


@functools.cache
def _java_classes() -> Path:
    """RecordFileProducer compiled once per process against Kafka 4.4.0's client jars."""
    javac = shutil.which("javac")
    if javac is None:
        raise RuntimeError("javac not found: the Java producer needs a JDK (Debian: openjdk-17-jdk-headless)")
    with _compile_lock:
        out = Path(tempfile.mkdtemp(prefix="sandbox-lanes-java-producer-"))
        done = subprocess.run(
            [javac, "-nowarn", "-d", str(out), "-cp", f"{_lib()}/*", str(_JAVA_SOURCE)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"javac failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return out


def _bytes(data: bytes | None) -> bytes:
    return struct.pack(">i", -1) if data is None else struct.pack(">i", len(data)) + data


def _utf(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">H", len(data)) + data


def java_produce(bootstrap: str, records: Sequence[RawRecord], **properties: str) -> list[tuple[int, int]]:
    """Send ``records`` with Kafka's Java producer; their (partition, offset) in order."""
    classes = _java_classes()
    with tempfile.TemporaryDirectory(prefix="sandbox-lanes-java-records-") as work:
        path = Path(work) / "records.bin"
        chunks = [struct.pack(">i", len(records))]
        for rec in records:
            chunks += [_utf(rec.compression), _utf(rec.topic), _bytes(rec.key), _bytes(rec.value)]
            chunks.append(struct.pack(">i", len(rec.headers)))
            chunks += [_utf(k) + _bytes(v) for k, v in rec.headers]
        path.write_bytes(b"".join(chunks))
        cache = prepare()
        cmd = [
            "java", *TOOL_JVM_OPTS,
            f"-Dlog4j2.configurationFile={cache / 'log4j2.xml'}",
            f"-Dkafka.logs.dir={work}",
            "-cp", f"{classes}:{_lib()}/*", "RecordFileProducer", bootstrap, str(path),
            *(f"{k.replace('_', '.')}={v}" for k, v in properties.items()),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the Java producer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    placed = [tuple(map(int, line.split())) for line in done.stdout.split("\n") if line.strip()]
    assert len(placed) == len(records), done.stdout
    return [(p, o) for p, o in placed]


# --- librdkafka -----------------------------------------------------------------------------------


def librdkafka_produce(bootstrap: str, records: Sequence[RawRecord]) -> list[tuple[int, int]]:
    """Send ``records`` with librdkafka, one producer per codec; their (partition, offset) in order."""
    placed: dict[int, tuple[int, int]] = {}
    failures: list[str] = []
    producers: dict[str, Producer] = {}

    def delivered(index: int) -> object:
        def report(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failures.append(f"record {index}: {err}")
            else:
                placed[index] = (msg.partition(), msg.offset())

        return report

    for index, rec in enumerate(records):
        producer = producers.get(rec.compression)
        if producer is None:
            producer = producers[rec.compression] = Producer(
                {
                    "bootstrap.servers": bootstrap,
                    "compression.type": rec.compression,
                    "acks": "all",
                    "linger.ms": 100,
                    "enable.idempotence": True,
                    "partitioner": "murmur2_random",  # the Java client's (and the pod's) partitioner
                }
            )
        producer.produce(
            rec.topic, rec.value, rec.key, headers=list(rec.headers), on_delivery=delivered(index)
        )
    for producer in producers.values():
        left = producer.flush(60)
        assert left == 0, f"librdkafka: {left} records not delivered in 60 s"
    assert not failures, failures
    return [placed[i] for i in range(len(records))]


# --- what the broker stored -----------------------------------------------------------------------


@dataclass(frozen=True)
class StoredBatch:
    """A record batch where the broker keeps it: its segment file, its place in it, its header."""

    segment: Path
    position: int
    size: int
    base_offset: int
    codec: str
    control: bool


def stored_batches(log_dir: Path, topic: str, partition: int) -> list[StoredBatch]:
    """Every batch in the partition's log segments, in order (record format v2)."""
    batches: list[StoredBatch] = []
    for segment in sorted((log_dir / f"{topic}-{partition}").glob("*.log")):
        data = segment.read_bytes()
        pos = 0
        while pos + 23 <= len(data):
            base_offset, length = struct.unpack_from(">qi", data, pos)
            if length <= 0:
                break  # the preallocated tail of an active segment
            magic = data[pos + 16]
            (attributes,) = struct.unpack_from(">h", data, pos + 21)
            assert magic == 2, f"{segment}: batch at {pos} has magic {magic}"
            codec = CODEC_NAMES[attributes & 0x07]
            batches.append(
                StoredBatch(segment, pos, 12 + length, base_offset, codec, bool(attributes & 0x20))
            )
            pos += 12 + length
    return batches


def stored_codecs(log_dir: Path, topic: str, partition: int) -> list[str]:
    """The codec of each data batch (control batches left out) in the partition's segments, in order."""
    return [b.codec for b in stored_batches(log_dir, topic, partition) if not b.control]


def corrupt_batch(log_dir: Path, topic: str, partition: int, offset: int) -> StoredBatch:
    """Flip one bit of the last byte of the batch holding ``offset``, in the broker's own log file: the
    batch keeps its shape, its CRC no longer matches (as a disk or a copy can damage it after the
    broker checked it on append). The broker serves the file as it is, so readers meet it."""
    (batch,) = [b for b in stored_batches(log_dir, topic, partition) if b.base_offset == offset]
    with batch.segment.open("r+b") as f:
        f.seek(batch.position + batch.size - 1)
        last = f.read(1)[0]
        f.seek(batch.position + batch.size - 1)
        f.write(bytes([last ^ 0x01]))
    return batch
