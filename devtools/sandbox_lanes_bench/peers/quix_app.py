"""The pod's job as a Quix Streams application: a StreamingDataFrame with RocksDB state (changelog
topic) and ``to_topic``; exactly-once or at-least-once as Quix offers them."""

from __future__ import annotations

import logging
from typing import Any

from sandbox_lanes_bench.peers.job import arguments, inline_ensure, new_state


def main() -> None:
    from quixstreams import Application, State

    args = arguments(__doc__ or "")
    app = Application(
        broker_address=args.bootstrap,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        processing_guarantee="exactly-once" if args.guarantee == "exactly_once" else "at-least-once",
        state_dir=args.state_dir,
        loglevel=logging.getLevelName(args.log_level),
    )
    source = app.topic(args.source, key_deserializer="bytes", value_deserializer="bytes")
    sink = app.topic(args.sink, key_serializer="bytes", value_serializer="bytes")
    ensure = inline_ensure(args)

    def apply(value: bytes, state: State[Any, Any]) -> Any:
        new, outcome = new_state(value, state.get("execution"))
        if outcome is not None:
            ensure()  # the driver call, inline (bench figure "slow_driver"; a no-op otherwise)
        state.set("execution", new)
        return outcome

    sdf = app.dataframe(source)
    sdf = sdf.apply(apply, stateful=True).filter(lambda outcome: outcome is not None)
    sdf.to_topic(sink)
    app.run()


if __name__ == "__main__":
    main()
