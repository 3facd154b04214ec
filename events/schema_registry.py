"""A Confluent-compatible Schema Registry, asked which message a framed record's schema id is.

The codec reads the framing (:mod:`events.wire_formats`) and, when a registry is configured
(``SANDBOX_LANES_SCHEMA_REGISTRY_URL``: :func:`configure` sets :data:`ACTIVE`), checks the id's
message against the one the topic carries, from this cache only (the codec never waits on the
network). An id not cached yet is fetched off the event loop (a thread), once, and kept for the
process's life (an id's schema never changes).

The runtime resolves a record's id before it decodes it (``await ensure(value)``); where it does
not, the codec raises :class:`SchemaNotResolved` and starts the fetch, so the partition's
transaction fails as the world's fault, rests (the pod's :class:`resilience.episode.Episode`
backoff) and finds the id cached on its next try. A registry that does not answer is the world's
fault too (:class:`RegistryUnavailable`: retried, never a dead letter); a registry that answers that
the id does not exist is the record's (:class:`events.codec.DecodeError` with that reason).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from events.proto_text import ProtoFile, ProtoTextError, parse_schema
from events.wire_formats import MAGIC_BYTE, WireFormatError, read_framing

#: Bound on one registry request (a lookup runs in a thread: the event loop never waits on it).
REQUEST_TIMEOUT_S: Final = 5.0
#: The Confluent error code of "schema not found" (HTTP 404).
SCHEMA_NOT_FOUND: Final = 40403


class RegistryUnavailable(ConnectionError):
    """The registry did not answer (or answered 5xx): the world's fault, retried with backoff."""


class SchemaNotResolved(LookupError):
    """A framed record's schema id is not cached yet: its lookup has been started; try again."""

    def __init__(self, schema_id: int) -> None:
        super().__init__(f"schema id {schema_id} is being looked up in the schema registry")
        self.schema_id = schema_id


@dataclass(frozen=True)
class RegisteredSchema:
    """A schema id's answer: its ``.proto`` declarations, or why the id cannot be used (``refusal``)."""

    schema_id: int
    proto: ProtoFile | None
    refusal: str = ""

    def message_name(self, indexes: tuple[int, ...]) -> str:
        """The full name of the message ``indexes`` names; raises ``ValueError`` with the refusal."""
        if self.proto is None:
            raise ValueError(self.refusal)
        try:
            return self.proto.message_name(indexes)
        except ProtoTextError as exc:
            raise ValueError(f"schema id {self.schema_id}: {exc}") from None


Fetch = Callable[[str, str, bytes | None], tuple[int, bytes]]


def _http(method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
    """One request: (status, body). A connection failure raises :class:`RegistryUnavailable`."""
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Accept", "application/vnd.schemaregistry.v1+json, application/json")
    if body is not None:
        request.add_header("Content-Type", "application/vnd.schemaregistry.v1+json")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, TimeoutError) as exc:
        raise RegistryUnavailable(f"schema registry {url} did not answer: {exc}") from exc


class SchemaRegistry:
    """The lookups of one registry, cached."""

    def __init__(self, url: str, *, fetch: Fetch = _http) -> None:
        self.url = url.rstrip("/")
        self._fetch = fetch
        self._cache: dict[int, RegisteredSchema] = {}
        self._pending: dict[int, asyncio.Task[RegisteredSchema]] = {}

    def cached(self, schema_id: int) -> RegisteredSchema | None:
        return self._cache.get(schema_id)

    def lookup_blocking(self, schema_id: int) -> RegisteredSchema:
        """The id's schema, fetched now if not cached (the tools; the pod uses :meth:`resolve`)."""
        known = self._cache.get(schema_id)
        if known is not None:
            return known
        status, body = self._fetch("GET", f"{self.url}/schemas/ids/{schema_id}", None)
        resolved = self._answer(schema_id, status, body)
        self._cache[schema_id] = resolved
        return resolved

    async def resolve(self, schema_id: int) -> RegisteredSchema:
        """The id's schema, fetched in a thread once however many records ask at the same time."""
        known = self._cache.get(schema_id)
        if known is not None:
            return known
        task = self._pending.get(schema_id)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self.lookup_blocking, schema_id))
            self._pending[schema_id] = task
            task.add_done_callback(lambda _t: self._pending.pop(schema_id, None))
        return await asyncio.shield(task)

    def want(self, schema_id: int) -> None:
        """Start the id's lookup in the background when an event loop runs (the codec's miss)."""
        if schema_id in self._cache or schema_id in self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(asyncio.to_thread(self.lookup_blocking, schema_id))
        self._pending[schema_id] = task
        # A failed background lookup is retried by the next miss; its exception is consumed here.
        task.add_done_callback(lambda t: (self._pending.pop(schema_id, None), t.cancelled() or t.exception()))

    async def ensure(self, value: bytes | None) -> None:
        """Resolve a framed value's schema id before the codec reads it (no-op for anything else).

        Raises :class:`RegistryUnavailable` when the registry does not answer: the caller's
        transaction fails as the world's fault and is retried with backoff.
        """
        if not value or value[0] != MAGIC_BYTE:
            return
        try:
            framing = read_framing(value)
        except WireFormatError:
            return  # the codec names what is wrong with it
        if framing.schema_id not in self._cache:
            await self.resolve(framing.schema_id)

    def _answer(self, schema_id: int, status: int, body: bytes) -> RegisteredSchema:
        if status == 404:
            return RegisteredSchema(schema_id, None, f"schema id {schema_id} is not in the schema registry")
        if status != 200:
            raise RegistryUnavailable(
                f"schema registry {self.url} answered {status} for schema id {schema_id}"
            )
        try:
            answer = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RegistryUnavailable(f"schema registry {self.url} answered with no JSON: {exc}") from None
        schema_type = answer.get("schemaType", "AVRO")
        if schema_type != "PROTOBUF":
            return RegisteredSchema(
                schema_id, None, f"schema id {schema_id} is a {schema_type} schema, not PROTOBUF"
            )
        return RegisteredSchema(schema_id, parse_schema(str(answer.get("schema", ""))))

    # --- writing ------------------------------------------------------------------------------

    def register_blocking(self, subject: str, schema: str, references: list[dict[str, object]]) -> int:
        """Register (or find) a protobuf schema under ``subject``; its id."""
        body = json.dumps({"schemaType": "PROTOBUF", "schema": schema, "references": references}).encode()
        quoted = urllib.parse.quote(subject, safe="")
        status, answer = self._fetch("POST", f"{self.url}/subjects/{quoted}/versions", body)
        if status != 200:
            raise RegistryUnavailable(
                f"schema registry {self.url} refused subject {subject}: {status} {answer[:300]!r}"
            )
        schema_id = int(json.loads(answer)["id"])
        self._cache.setdefault(schema_id, RegisteredSchema(schema_id, parse_schema(schema)))
        return schema_id

    def version_blocking(self, subject: str, schema: str, references: list[dict[str, object]]) -> int:
        """The version under ``subject`` of a schema registered there (for a reference to it)."""
        body = json.dumps({"schemaType": "PROTOBUF", "schema": schema, "references": references}).encode()
        quoted = urllib.parse.quote(subject, safe="")
        status, answer = self._fetch("POST", f"{self.url}/subjects/{quoted}", body)
        if status != 200:
            raise RegistryUnavailable(
                f"schema registry {self.url} did not find the schema under {subject}: "
                f"{status} {answer[:300]!r}"
            )
        return int(json.loads(answer)["version"])


#: The process's registry (``SANDBOX_LANES_SCHEMA_REGISTRY_URL``), or None: framing read, id recorded.
ACTIVE: SchemaRegistry | None = None


def configure(url: str) -> SchemaRegistry | None:
    """Set :data:`ACTIVE` from the setting's value ("" = none)."""
    global ACTIVE
    ACTIVE = SchemaRegistry(url) if url else None
    return ACTIVE


async def ensure(value: bytes | None) -> None:
    """:meth:`SchemaRegistry.ensure` of :data:`ACTIVE` (the runtime's one line before it decodes)."""
    if ACTIVE is not None:
        await ACTIVE.ensure(value)
