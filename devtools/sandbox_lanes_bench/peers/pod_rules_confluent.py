"""The pod's own per-record work on a confluent-kafka loop: what moving the runtime to librdkafka
would give, measured beside the pod (the client question of the zombie-fencing issue).

Per record, as the pod: the strict codec's decode, ``decide`` on the stored state, the pending state
written, the memory driver's result folded back with ``complete``, the outcome and the final state
written (three writes per input), the state kept serialized by key. Unlike the pod, the result is
folded back in the same transaction (no outbox, no driver call, no token mint): a ceiling for the
rules and the codec on librdkafka, not a runtime.
"""

from __future__ import annotations

import signal
from typing import Any

from sandbox_lanes_bench.peers.job import arguments, confluent_clients


def main() -> None:
    from confluent_kafka import KafkaException, TopicPartition

    from consumers.lanes.commands import CommandResult, StateView
    from consumers.lanes.rules import complete, decide
    from events.codec import decode_input, encode, state_key
    from events.sandbox_lanes.v1 import state_pb2
    from sandbox_lanes_bench.common import bench_lane_config

    args = arguments(__doc__ or "")
    config = bench_lane_config()
    ok = CommandResult(ok=True, probe_state="running", token_minted=True)
    state_topic = f"{args.group}-changelog"
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    consumer, producer = confluent_clients(args, transactional=True)
    consumer.subscribe([args.source])
    store: dict[str, bytes] = {}
    while not stop[0]:
        batch = consumer.consume(num_messages=500, timeout=0.2)
        if not batch:
            continue
        producer.begin_transaction()
        offsets: dict[tuple[str, int], int] = {}
        for msg in batch:
            if msg.error():
                raise KafkaException(msg.error())
            headers: Any = msg.headers() or []
            event = decode_input(msg.key(), msg.value(), headers)
            key = state_key(event)
            raw = store.get(key)
            stored = state_pb2.ExecutionState.FromString(raw) if raw is not None else None
            decision = decide(event, StateView(stored), config)
            if decision.state is not None:
                pending = encode(decision.state)
                producer.produce(state_topic, pending.value, pending.key, headers=pending.headers)
                outcome = complete(decision, [ok] * len(decision.commands), config)
                for output in outcome.outputs:
                    rec = encode(output, source=config.source)
                    producer.produce(args.sink, rec.value, rec.key, headers=rec.headers)
                if outcome.state is not None:
                    final = encode(outcome.state)
                    producer.produce(state_topic, final.value, final.key, headers=final.headers)
                    store[key] = final.value
            offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            producer.poll(0)
        positions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        producer.send_offsets_to_transaction(positions, consumer.consumer_group_metadata())
        producer.commit_transaction()
    consumer.close()


if __name__ == "__main__":
    main()
