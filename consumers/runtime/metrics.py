"""Prometheus metrics of the pod. One :class:`PodMetrics` per pod, on its own registry.

Label values are bounded vocabularies (event types, lanes, outcomes, driver
names, topic/partition) — never ids, never anything a producer controls freely.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from consumers.lanes.commands import Decision, Deprovision, Ensure, Outcome
from events.codec import OutcomeEvent
from events.sandbox_lanes.v1 import common_pb2, inputs_pb2

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PodMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events_consumed = Counter(
            "sandbox_lanes_events_consumed",
            "Input events consumed, by event type and input partition",
            ["type", "partition"],
            registry=r,
        )
        self.decisions = Counter(
            "sandbox_lanes_decisions", "Lane decisions, by lane and outcome", ["lane", "outcome"], registry=r
        )
        self.outputs = Counter(
            "sandbox_lanes_outputs", "Outcome events written, by type", ["type"], registry=r
        )
        self.driver_seconds = Histogram(
            "sandbox_lanes_driver_seconds",
            "Driver call latency (provisioning = ensure, teardown = deprovision), by driver",
            ["driver", "operation", "result"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.dead_letters = Counter(
            "sandbox_lanes_dead_letters",
            "Records sent to the dead-letter topic, by reason class (DEAD_LETTER_REASONS)",
            ["reason"],
            registry=r,
        )
        for reason in DEAD_LETTER_REASONS:  # each series at 0 from the start: increase() sees the first
            self.dead_letters.labels(reason)
        self.fences = Counter(
            "sandbox_lanes_fences",
            "Transactions refused because the partition's transactional id has a newer epoch (stood down)",
            registry=r,
        )
        self.producers_abandoned = Counter(
            "sandbox_lanes_producers_abandoned",
            "Partition producers abandoned past a broker wait's deadline or a failed abort (taken over anew)",
            registry=r,
        )
        self.producers_lingering = Gauge(
            "sandbox_lanes_producers_lingering",
            "Closed partition producers whose threads are still stuck in a broker wait (capped: past"
            " the cap no new producer is opened until some end)",
            registry=r,
        )
        self.duplicates = Counter("sandbox_lanes_duplicates", "Redelivered inputs ignored", registry=r)
        self.unparsable = Counter(
            "sandbox_lanes_unparsable_fetches",
            "Fetches that met a record the Kafka client cannot parse (the record is dead-lettered)",
            registry=r,
        )
        self.results_dropped = Counter(
            "sandbox_lanes_results_dropped",
            "Driver results whose fold-back failed the same way every attempt, given up",
            registry=r,
        )
        self.states_removed = Counter(
            "sandbox_lanes_states_removed",
            "Finished executions' states tombstoned after the retention period",
            registry=r,
        )
        self.assigned_partitions = Gauge(
            "sandbox_lanes_assigned_partitions",
            "Input partitions assigned to this pod (0 on an idle member)",
            registry=r,
        )
        self.commits_failing = Gauge(
            "sandbox_lanes_commits_failing_seconds",
            "How long every commit has failed (0 once one goes through)",
            registry=r,
        )
        self.ready = Gauge("sandbox_lanes_ready", "1 while /readyz answers 200", registry=r)
        self.build_info = Gauge(
            "sandbox_lanes_build_info",
            "The running build (value 1): package version and source revision",
            ["version", "revision"],
            registry=r,
        )
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
        ProcessCollector(registry=r)
        self.consumer_lag = Gauge(
            "sandbox_lanes_consumer_lag",
            "Records behind the high watermark",
            ["topic", "partition"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "sandbox_lanes_batch_seconds",
            "Time to process and commit one batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_failures = Counter(
            "sandbox_lanes_commit_failures", "Batches rewound after a failure", registry=r
        )
        self.state_keys = Gauge(
            "sandbox_lanes_state_store_keys", "Executions held in the state store", registry=r
        )
        self.state_memory = Gauge(
            "sandbox_lanes_state_store_memory_bytes",
            "What the state store's database holds in memory: memtables, block cache, table readers"
            " (RocksDB store only; read at most once a second)",
            registry=r,
        )
        self.restore_seconds = Gauge(
            "sandbox_lanes_state_restore_seconds", "Duration of the last state restore", registry=r
        )
        self.restored_keys = Counter(
            "sandbox_lanes_state_restored_keys", "Keys restored from the state topic", registry=r
        )
        self.state_rebuilds = Counter(
            "sandbox_lanes_state_rebuilds",
            "Partitions whose local state was thrown away and rebuilt from the state topic, by reason",
            ["reason"],
            registry=r,
        )
        self.reaped = Counter(
            "sandbox_lanes_reaped_sandboxes", "Sandboxes removed by the reaper", ["driver"], registry=r
        )
        self.effects_outstanding = Gauge(
            "sandbox_lanes_effects_outstanding",
            "Driver calls decided and not yet folded back (queued, running or awaiting their commit)",
            registry=r,
        )
        self.time_to_sandbox = Histogram(
            "sandbox_lanes_time_to_sandbox_seconds",
            "From the commit of a decision to the commit of its outcome, by driver and operation",
            ["driver", "operation"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.leaked = Counter(
            "sandbox_lanes_leaked_sandboxes",
            "Teardowns that failed (the sandbox may be leaked)",
            ["driver"],
            registry=r,
        )
        self.engine_quota_waits = Counter(
            "sandbox_lanes_engine_quota_waits",
            "Ensures the engine refused for quota (full) and the pod began to wait out, by driver",
            ["driver"],
            registry=r,
        )
        self.engine_quota_timeouts = Counter(
            "sandbox_lanes_engine_quota_timeouts",
            "Engine quota waits that reached the admission timeout (the execution failed, 'capacity: ...')",
            ["driver"],
            registry=r,
        )
        self.engine_quota_waiting = Gauge(
            "sandbox_lanes_engine_quota_waiting",
            "Ensures waiting for engine capacity now (refused for quota, retried with backoff)",
            registry=r,
        )

        # ``.labels(...)`` takes a lock and validates per call; the label sets here are bounded
        # vocabularies, so the children are looked up once and kept (the registry keeps them too).
        self._decision_children: dict[tuple[str, str], Counter] = {}
        self._driver_children: dict[tuple[str, str, str], Histogram] = {}
        self._consumed_children: dict[tuple[str, int], Counter] = {}

    def set_build(self, version: str, revision: str) -> None:
        """``sandbox_lanes_build_info{version, revision} 1`` (one series: a previous one is removed)."""
        self.build_info.clear()
        self.build_info.labels(version or "unknown", revision or "unknown").set(1)

    def _decision(self, lane: str, outcome: str) -> Counter:
        child = self._decision_children.get((lane, outcome))
        if child is None:
            child = self._decision_children[(lane, outcome)] = self.decisions.labels(lane, outcome)
        return child

    def consumed(self, event_type: str, partition: int) -> Counter:
        """``events_consumed.labels(event_type, partition)``, cached (it is counted once per record)."""
        key = (event_type, partition)
        child = self._consumed_children.get(key)
        if child is None:
            child = self._consumed_children[key] = self.events_consumed.labels(event_type, str(partition))
        return child

    def driver_observer(self, driver: str, operation: str, result: str) -> Histogram:
        """``driver_seconds.labels(driver, operation, result)``, cached."""
        key = (driver, operation, result)
        child = self._driver_children.get(key)
        if child is None:
            child = self._driver_children[key] = self.driver_seconds.labels(driver, operation, result)
        return child

    def record_decision(self, decision: Decision, outcome: Outcome | None, driver: str) -> None:
        if decision.reject is not None:
            self._decision(_lane_of_event(decision), "rejected").inc()
            return
        if decision.duplicate:
            self._decision(_lane_of_event(decision), "duplicate").inc()
            return
        if not decision.commands:
            self._decision(_lane_of_event(decision), "skipped").inc()
            return
        for command, output in zip(decision.commands, outcome.outputs if outcome else (), strict=False):
            self.record_outcome(command, output, driver)

    def record_outcome(self, command: Ensure | Deprovision, output: OutcomeEvent, driver: str) -> None:
        """A driver call's outcome (the pod counts it when it folds the call's result back)."""
        kind = output.DESCRIPTOR.name  # == type_name(output).rsplit(".", 1)[-1]
        self._decision(lane_of_command(command), OUTCOME_WORDS.get(kind, kind)).inc()
        if kind == "SandboxTeardownFailed":
            self.leaked.labels(driver).inc()


OUTCOME_WORDS = {
    "SandboxProvisioned": "provisioned",
    "SandboxFailed": "failed",
    "SandboxDeprovisioned": "deprovisioned",
    "SandboxTeardownFailed": "teardown_failed",
}


def lane_of_command(command: Ensure | Deprovision) -> str:
    if isinstance(command, Ensure):
        return command.scope
    return "terminal" if command.scope == "workflow" else "session_delete"


def _lane_of_event(decision: Decision) -> str:
    event = decision.event
    if isinstance(event, inputs_pb2.ExecutionCreated):
        return "workflow" if event.kind == common_pb2.WORKFLOW_EXECUTION else "session"
    if isinstance(event, inputs_pb2.PhaseChanged):
        return "terminal"
    return "session_delete"


#: The ``reason`` label of ``sandbox_lanes_dead_letters_total``: a bounded class of the reason (the
#: reason itself is in the dead letter's ``dlq_reason`` header).
DEAD_LETTER_REASONS = (
    "undecodable",  # the codec refused it (garbage, a missing id or key, an unknown type or enum, ...)
    "wrong_topic",  # an event type its topic does not carry
    "clock_ahead",  # occurred_at too far ahead of the record's timestamp or of the pod's clock
    "unknown_execution",  # a phase change whose create never came
    "rejected",  # refused by the lane rules for another reason
    "oversize",  # its derived state would exceed the record limit
    "unparsable",  # the Kafka client cannot parse the record
    "transaction_failed",  # its transaction failed the same way every attempt
    "internal",  # the rules raised on it
)
