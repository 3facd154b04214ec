"""The pod's job as a plain confluent-kafka loop: one transactional producer, offsets sent with the
consumer's group metadata (KIP-447), state in a dict written to a compacted changelog, so two writes
per event (the pod's write shape) in one transaction per batch."""

from __future__ import annotations

import json
import signal
from typing import Any

from sandbox_lanes_bench.peers.job import arguments, confluent_clients, inline_ensure, new_state


def main() -> None:
    from confluent_kafka import KafkaException, TopicPartition

    args = arguments(__doc__ or "")
    eos = args.guarantee == "exactly_once"
    changelog = f"{args.group}-changelog"
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    ensure = inline_ensure(args)
    consumer, producer = confluent_clients(args, transactional=eos)
    consumer.subscribe([args.source])
    state: dict[bytes, dict[str, Any]] = {}
    while not stop[0]:
        batch = consumer.consume(num_messages=500, timeout=0.2)
        if not batch:
            continue
        if eos:
            producer.begin_transaction()
        offsets: dict[tuple[str, int], int] = {}
        for msg in batch:
            if msg.error():
                raise KafkaException(msg.error())
            key = msg.key() or b""
            new, outcome = new_state(msg.value(), state.get(key))
            state[key] = new
            producer.produce(changelog, json.dumps(new).encode(), key)
            if outcome is not None:
                ensure()  # the driver call, inline (bench figure "slow_driver"; a no-op otherwise)
                producer.produce(args.sink, outcome, key)
            offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            producer.poll(0)
        positions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        if eos:
            producer.send_offsets_to_transaction(positions, consumer.consumer_group_metadata())
            producer.commit_transaction()
        else:
            producer.flush()
            consumer.commit(offsets=positions, asynchronous=False)
    consumer.close()


if __name__ == "__main__":
    main()
