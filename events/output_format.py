"""Outcomes in the Schema Registry wire format, for consumers that use ``KafkaProtobufDeserializer``.

With ``SANDBOX_LANES_OUTPUT_FORMAT=schema-registry`` the pod registers ``outcomes.proto`` (and
``common.proto``, which it imports, as a reference under its import path, as Confluent's serializers
do) under the subject ``<outcomes topic>-value`` at startup, and from then on every outcome's value is
framed with that id and its message index (:func:`events.codec.encode`); its CloudEvents headers stay.
States and dead letters are not outcomes: they keep the project's own format.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from events.schema_registry import SchemaRegistry

OUTPUT_FORMATS: Final = ("cloudevents", "schema-registry")
_PROTO_PACKAGE: Final = "events.sandbox_lanes.v1"
COMMON_PROTO: Final = "events/sandbox_lanes/v1/common.proto"


def _text(name: str) -> str:
    return resources.files(_PROTO_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def register_outcomes(registry: SchemaRegistry, outcomes_topic: str) -> int:
    """Register the outcomes' schema (blocking; :class:`events.schema_registry.RegistryUnavailable`
    when the registry does not answer); its id."""
    common = _text("common.proto")
    registry.register_blocking(COMMON_PROTO, common, [])
    version = registry.version_blocking(COMMON_PROTO, common, [])
    reference: dict[str, object] = {"name": COMMON_PROTO, "subject": COMMON_PROTO, "version": version}
    return registry.register_blocking(f"{outcomes_topic}-value", _text("outcomes.proto"), [reference])
