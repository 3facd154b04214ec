"""The pod's job as a faust-streaming agent: a Table (in-memory store, changelog topic) and a sink
topic; faust's exactly-once or at-least-once."""

from __future__ import annotations

import sys
from typing import Any

from sandbox_lanes_bench.peers.job import arguments, new_state


def main() -> None:
    import faust

    args = arguments(__doc__ or "")
    app = faust.App(
        args.group,
        broker=f"kafka://{args.bootstrap}",
        store="memory://",
        processing_guarantee=args.guarantee,
        topic_partitions=args.partitions,
        topic_replication_factor=1,
        datadir=args.state_dir or None,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="json",
    )
    source = app.topic(args.source, key_type=bytes, value_type=bytes, key_serializer="raw",
                       value_serializer="raw")  # fmt: skip
    sink = app.topic(args.sink, key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw")  # fmt: skip
    table = app.Table("executions", default=None, key_type=bytes)

    @app.agent(source)
    async def provision(stream: Any) -> None:
        async for key, value in stream.items():
            new, outcome = new_state(value, table.get(key))
            table[key] = new
            if outcome is not None:
                await sink.send(key=key, value=outcome)

    sys.argv = [sys.argv[0], "worker", "--loglevel", "warn", "--without-web"]
    app.main()


if __name__ == "__main__":
    main()
