"""The pod's configuration, its counters, and the health it reports (values only: no I/O)."""

from __future__ import annotations

import socket
import time
from collections import Counter
from dataclasses import dataclass, field

from consumers.runtime.kafka_security import PLAINTEXT, KafkaSecurity
from consumers.runtime.sink import Guarantee
from consumers.runtime.topology import Topics


@dataclass(frozen=True)
class PodConfig:
    bootstrap: str
    group_id: str = "sandbox-lanes"
    topics: Topics = field(default_factory=Topics)
    partitions: int = 3
    #: -1: the broker's default.replication.factor.
    replication: int = -1
    guarantee: Guarantee = "exactly_once"
    sequential_produce: bool = False
    pod_id: str = field(default_factory=socket.gethostname)
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_batch: int = 500
    poll_timeout_ms: int = 200
    shutdown_timeout_s: float = 30.0
    transaction_timeout_ms: int = 15_000
    create_topics: bool = True
    #: Attempts of a record whose transaction fails deterministically (size, encoding, a bug)
    #: before it is dead-lettered; failures of the world (broker, fence, timeout) retry for ever.
    dead_letter_attempts: int = 3
    #: How far an input's ``occurred_at`` may run ahead of its record timestamp (clock skew).
    max_clock_ahead_s: float = 300.0
    #: A finished execution's state is tombstoned this long after its last input (0 = never).
    state_retention_s: float = 604_800.0
    #: Driver calls running at once across executions (calls for one sandbox run one at a time).
    driver_concurrency: int = 32
    #: TLS / SASL of every Kafka client the pod opens.
    security: KafkaSecurity = PLAINTEXT


@dataclass
class PodStats:
    consumed: Counter[str] = field(default_factory=Counter)
    outputs: Counter[str] = field(default_factory=Counter)
    dead_lettered: int = 0
    duplicates: int = 0
    batches: int = 0
    commit_failures: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    restored_keys: int = 0
    restore_seconds: float = 0.0
    #: The longest transaction so far (begin to commit), seconds: no driver call is inside one.
    max_transaction_s: float = 0.0
    #: Since when every commit has failed (monotonic); None after a commit succeeds.
    commits_failing_since: float | None = None
    #: The last failed commit (monotonic).
    last_commit_failure: float = 0.0


@dataclass(frozen=True)
class Health:
    """What /healthz and /readyz report."""

    alive: bool
    ready: bool
    restoring: bool
    assigned_partitions: int
    seconds_since_loop: float
    detail: str


def assess_health(
    *,
    now: float,
    running: bool,
    last_loop: float,
    stats: PodStats,
    assigned: int,
    restoring: bool,
    restored: bool,
    stall_after_s: float,
) -> Health:
    """Alive: the loop turned, and a commit succeeded, within ``stall_after_s``.

    Ready: alive, state restored, partitions held. A pod whose commits keep failing (a
    producer in a fatal state, a broker it cannot write to) turns its loop but decides
    nothing durable: liveness fails so that its supervisor restarts it.
    """
    since = now - last_loop
    # Failing: no commit succeeded since the first failure, and they still fail (a pod that
    # failed and then had nothing to commit, e.g. its partitions moved away, is not wedged).
    failing = stats.commits_failing_since
    still = now - stats.last_commit_failure < stall_after_s
    failing_for = now - failing if failing is not None and still else 0.0
    alive = running and since < stall_after_s and failing_for < stall_after_s
    ready = alive and not restoring and restored and assigned > 0
    if not running:
        detail = "not running"
    elif since >= stall_after_s:
        detail = f"loop stalled for {since:.1f}s"
    elif failing_for >= stall_after_s:
        detail = f"commits failing for {failing_for:.1f}s"
    elif restoring:
        detail = "restoring state"
    elif assigned == 0:
        detail = "no partitions assigned"
    else:
        detail = "ok"
    return Health(alive, ready, restoring, assigned, since, detail)
