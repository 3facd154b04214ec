"""The per-record work every peer does, so the frameworks differ only in how they consume, store
and produce: decode the protobuf ``ExecutionCreated``, derive the sandbox's deterministic name, keep
a per-execution state and write one protobuf ``SandboxProvisioned`` (uuid5 id, CloudEvents headers).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from drivers.naming import sandbox_base_name
from events.codec import derived_event_id, encode, new_meta
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2, outcomes_pb2

SOURCE = "bench-peer"


def new_state(value: bytes, state: dict[str, Any] | None) -> tuple[dict[str, Any], bytes | None]:
    """(the execution's new state, the outcome's bytes or None when the input was applied before)."""
    created = inputs_pb2.ExecutionCreated.FromString(value)
    event_id = created.meta.event_id
    if state is not None and event_id in state["applied"]:
        return state, None
    name = sandbox_base_name("workflow", created.execution_id)
    outcome = outcomes_pb2.SandboxProvisioned(
        meta=new_meta(
            event_id=derived_event_id(event_id, "SandboxProvisioned", "workflow"),
            source=SOURCE,
            causation_id=event_id,
        ),
        execution_id=created.execution_id,
        sandbox=common_pb2.SandboxRef(
            scope=common_pb2.SANDBOX_SCOPE_WORKFLOW,
            sandbox_id=created.execution_id,
            name=name,
            driver="memory",
            task_queue=f"stigmer_runner_{created.execution_id}",
        ),
        probe_state="running",
    )
    new = {
        "execution_id": created.execution_id,
        "phase": "provisioned",
        "sandbox": name,
        "applied": [*(state["applied"] if state else []), event_id],
    }
    return new, encode(outcome, source=SOURCE).value


def inline_ensure(args: argparse.Namespace) -> Callable[[], None]:
    """The driver call as an inline design makes it: a blocking wait per ensure, drawn uniformly from
    ``--ensure-latency-ms LO,HI`` with ``--seed`` (the memory driver's draws for ``ensure_latency_ms=LO``,
    ``latency_jitter_ms=HI-LO`` and the same seed: the same sequence of waits). No-op without it."""
    if not args.ensure_latency_ms:
        return lambda: None
    low, high = (float(v) for v in args.ensure_latency_ms.split(","))
    rng = random.Random(args.seed)

    def ensure() -> None:
        time.sleep((low + rng.uniform(0, high - low)) / 1000)

    return ensure


def confluent_clients(args: argparse.Namespace, *, transactional: bool) -> tuple[Any, Any]:
    """The confluent-kafka loops' group consumer (read_committed, manual offsets) and producer
    (transactional: initialised, its offsets to be sent with the consumer's group metadata)."""
    from confluent_kafka import Consumer, Producer

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    options: dict[str, Any] = {"bootstrap.servers": args.bootstrap, "linger.ms": 5}
    if transactional:
        options["transactional.id"] = f"{args.group}-tx"
    producer = Producer(options)
    if transactional:
        producer.init_transactions()
    return consumer, producer


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--source", required=True, help="input topic (ExecutionCreated)")
    parser.add_argument("--sink", required=True, help="output topic (SandboxProvisioned)")
    parser.add_argument("--group", required=True, help="consumer group / application id")
    parser.add_argument("--guarantee", choices=("exactly_once", "at_least_once"), default="exactly_once")
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--state-dir", default="", help="where a peer keeps local state")
    parser.add_argument("--log-level", default="WARNING", help="the framework's log level")
    parser.add_argument("--ensure-latency-ms", default="", help="LO,HI: a blocking driver call per ensure")
    parser.add_argument("--seed", type=int, default=0, help="seed of the driver call's latency draws")
    return parser.parse_args()
