"""Every compression codec a Kafka producer may use, readable before anything is read.

A producer picks its codec (``compression.type``: ``gzip``, ``snappy``, ``lz4``, ``zstd``; Java
and librdkafka clients, or a topic's own ``compression.type``, often default to one of them), and
every reader of the pod's topics (the group consumer, restore, replay, ``tail``, the reaper) reads
its batches through aiokafka. aiokafka decompresses snappy, lz4 and zstd only with ``cramjam``
installed (its ``snappy``, ``lz4`` and ``zstd`` extras); without it a fetch of such a batch raises
``UnsupportedCodecError`` at the record, which looks like a record the client cannot parse. So the
check is made once at start, and a missing codec is a startup error that names it, never a dead
letter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aiokafka import codec as kafka_codec
from aiokafka.errors import UnsupportedCodecError

#: The codecs Kafka's record format knows (attribute bits 1..4), in that order.
CODECS: Final = ("gzip", "snappy", "lz4", "zstd")

#: Compressible and recognisable: a round trip of it proves the codec decompresses.
_SAMPLE: Final = b"sandbox-lanes codec check " * 8


class MissingCodecError(UnsupportedCodecError):  # type: ignore[misc]  # aiokafka ships no types
    """The Kafka client cannot decompress some codec a producer may use; the message names it.

    aiokafka's own error for a codec whose library is missing, raised at start instead of at a
    record: a Kafka error, so each command's error line says it (exit 2).
    """

    def __init__(self, missing: dict[str, str]) -> None:
        self.missing = dict(missing)
        names = ", ".join(self.missing)
        causes = "; ".join(f"{name}: {cause}" for name, cause in self.missing.items())
        super().__init__(
            f"the Kafka client (aiokafka) cannot decompress {names} ({causes}): records a producer "
            f"compressed with {names} could not be read. Install aiokafka's codec extras: "
            "pip install 'aiokafka[lz4,snappy,zstd]' (cramjam)"
        )

    def __str__(self) -> str:
        return str(self.args[0])  # the message alone (KafkaError's own prefixes the class name)


def _round_trip(name: str) -> None:
    """Raise unless aiokafka reports ``name`` and decompresses what it compressed with it."""
    has: Callable[[], bool] = getattr(kafka_codec, f"has_{name}")
    if not has():
        raise RuntimeError(f"aiokafka.codec.has_{name}() is false")
    encode: Callable[[bytes], bytes] = getattr(kafka_codec, f"{name}_encode")
    decode: Callable[[bytes], bytes] = getattr(kafka_codec, f"{name}_decode")
    if decode(encode(_SAMPLE)) != _SAMPLE:
        raise RuntimeError("a round trip changed the bytes")


def missing_codecs() -> dict[str, str]:
    """Each codec aiokafka cannot decompress here, with why (empty: every codec is read)."""
    missing: dict[str, str] = {}
    for name in CODECS:
        try:
            _round_trip(name)
        except Exception as exc:  # an import, a library or a wrong answer: the codec is not there
            missing[name] = f"{type(exc).__name__}: {exc}"
    return missing


def require_codecs() -> None:
    """Raise :class:`MissingCodecError` naming every codec aiokafka cannot decompress."""
    missing = missing_codecs()
    if missing:
        raise MissingCodecError(missing)
