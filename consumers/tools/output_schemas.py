"""At start-up, register the outcomes' schema when outcomes are written in the Schema Registry format.

A registry that does not answer is waited out (the world's fault: :class:`resilience.episode.Episode`,
one ERROR line per outage, the one backoff); the pod starts consuming only once outcomes can be framed.
"""

from __future__ import annotations

import asyncio
import logging

from consumers.ops.settings import Settings
from events import schema_registry
from events.codec import frame_outcomes
from events.output_format import register_outcomes
from resilience.episode import Episode


async def register_output_schemas(settings: Settings, log: logging.Logger) -> int | None:
    """Frame outcomes from here on when ``SANDBOX_LANES_OUTPUT_FORMAT=schema-registry``; the schema id."""
    if settings.output_format != "schema-registry":
        frame_outcomes(None)
        return None
    registry = schema_registry.ACTIVE or schema_registry.configure(settings.schema_registry_url)
    assert registry is not None  # the settings refuse schema-registry without a URL
    episode = Episode("registering the outcomes' schema", log, extra={"registry": registry.url})
    while True:
        try:
            schema_id = await asyncio.to_thread(register_outcomes, registry, settings.topics.outcomes)
        except schema_registry.RegistryUnavailable as exc:
            await asyncio.sleep(episode.failed(exc))
            continue
        episode.recovered()
        frame_outcomes(schema_id)
        log.info(
            "outcomes framed in the Schema Registry format",
            extra={"schemaId": schema_id, "subject": f"{settings.topics.outcomes}-value"},
        )
        return schema_id
