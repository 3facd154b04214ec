"""Every codec a Kafka producer may use is read, or the pod and its tools refuse to start, naming it.

A codec is made to look missing by patching aiokafka's own check (``aiokafka.codec.has_<codec>``),
the one its record readers ask before they decompress a batch: the first test shows that the
patch makes aiokafka's reader refuse such a batch exactly as a missing library does. The real
codecs, written by Java and librdkafka producers through a real broker, are read in
tests/integration/test_compressed_inputs.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka import codec as kafka_codec
from aiokafka.errors import KafkaError, UnsupportedCodecError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords

from consumers.ops.compose import compose
from consumers.ops.settings import load_settings
from consumers.runtime.kafka.codecs import CODECS, MissingCodecError, missing_codecs, require_codecs
from consumers.tools import cli
from consumers.tools.replay.command import lane_config
from consumers.tools.replay.derive import replay
from consumers.tools.topic_io import tail

#: Kafka's codec ids in a record batch's attributes.
CODEC_IDS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
#: Nothing listens here: a tool that got past the check would fail to connect instead.
NOWHERE = "127.0.0.1:1"


def _batch(codec: str, values: list[bytes]) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=CODEC_IDS[codec],
        is_transactional=False,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for offset, value in enumerate(values):
        builder.append(offset, timestamp=None, key=b"k", value=value, headers=[("ce_type", b"t")])
    return bytes(builder.build())


def _read(batch: bytes) -> list[bytes]:
    records = MemoryRecords(batch)
    out: list[bytes] = []
    while records.has_next():
        got = records.next_batch()
        assert got is not None
        out.extend(rec.value for rec in got)
    return out


def _lose(monkeypatch: pytest.MonkeyPatch, *codecs: str) -> None:
    for name in codecs:
        monkeypatch.setattr(kafka_codec, f"has_{name}", lambda: False)


@pytest.mark.parametrize("codec", CODECS)
def test_each_codec_is_read_here_and_a_lost_one_is_refused_by_the_reader(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = [b"\n\x00binary \xff value %d" % i for i in range(5)]
    batch = _batch(codec, values)
    assert _read(batch) == values  # the installed client decompresses it
    assert codec not in missing_codecs()
    _lose(monkeypatch, codec)
    with pytest.raises(UnsupportedCodecError):  # what a fetch of such a batch raised without cramjam
        _read(batch)
    assert set(missing_codecs()) == {codec}


def test_every_codec_a_producer_may_use_is_installed() -> None:
    assert CODECS == ("gzip", "snappy", "lz4", "zstd")
    assert missing_codecs() == {}
    require_codecs()


def test_the_error_names_each_missing_codec_and_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    _lose(monkeypatch, "lz4", "zstd")
    with pytest.raises(MissingCodecError) as caught:
        require_codecs()
    assert set(caught.value.missing) == {"lz4", "zstd"}
    text = str(caught.value)
    assert text.startswith("the Kafka client (aiokafka) cannot decompress lz4, zstd ")
    assert "gzip" not in text and "snappy" not in text.split("pip install")[0]
    assert "aiokafka[lz4,snappy,zstd]" in text
    # A Kafka error (aiokafka's own for a missing codec library): the CLI's one error line, exit 2.
    assert isinstance(caught.value, KafkaError)


def test_a_codec_that_answers_wrong_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_codec, "snappy_decode", lambda payload: b"not what was written")
    assert set(missing_codecs()) == {"snappy"}
    assert "round trip" in missing_codecs()["snappy"]


async def test_the_pod_refuses_to_start_before_it_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings({"KAFKA_BOOTSTRAP_SERVERS": NOWHERE, "SANDBOX_PROVISIONER_TYPE": ""})
    composed = compose(settings, logging.getLogger("sandbox_lanes"))
    _lose(monkeypatch, "snappy")
    with pytest.raises(MissingCodecError, match="cannot decompress snappy"):
        await asyncio.wait_for(composed.pod.start(), 10)


async def test_replay_and_tail_refuse_before_they_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings({"KAFKA_BOOTSTRAP_SERVERS": NOWHERE})
    _lose(monkeypatch, "zstd")
    with pytest.raises(MissingCodecError, match="cannot decompress zstd"):
        await asyncio.wait_for(replay(NOWHERE, settings.topics, lane_config(settings)), 10)
    with pytest.raises(MissingCodecError, match="cannot decompress zstd"):
        await asyncio.wait_for(tail(NOWHERE, [settings.topics.outcomes]), 10)


@pytest.mark.parametrize("command", [["tail"], ["replay"], ["reap"]])
def test_each_reading_command_says_it_in_one_line(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", NOWHERE)
    monkeypatch.setenv("SANDBOX_PROVISIONER_TYPE", "local-process")
    _lose(monkeypatch, "lz4")
    assert cli.main([*command, "--bootstrap", NOWHERE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"sandbox-lanes {command[0]}: Kafka: MissingCodecError: "), err
    assert "cannot decompress lz4 " in err[0]


def test_the_pod_command_exits_with_the_error_instead_of_retrying(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sandbox-lanes run`: a missing codec is not a world fault waited out; the process ends, exit 2."""
    for name, value in {
        "KAFKA_BOOTSTRAP_SERVERS": NOWHERE,
        "SANDBOX_PROVISIONER_TYPE": "",
        "SANDBOX_LANES_HTTP_PORT": "0",
        "SANDBOX_LANES_REAP_INTERVAL_S": "0",
    }.items():
        monkeypatch.setenv(name, value)
    _lose(monkeypatch, "snappy", "zstd")
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sandbox-lanes run: Kafka: MissingCodecError: "), err
    assert "cannot decompress snappy, zstd " in err[-1]
