"""The pod's configuration, its counters, and the health it reports (values only: no I/O)."""

from __future__ import annotations

import socket
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from consumers.runtime.kafka.security import PLAINTEXT, KafkaSecurity
from consumers.runtime.kafka.sink import Guarantee
from consumers.runtime.kafka.topology import Topics


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
    #: Join the group as static member ``pod_id`` (KIP-345): a restart within the session timeout
    #: gets its partitions back without a rebalance. Only with stable pod names (a StatefulSet).
    static_membership: bool = False
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
    #: The caps (0: none) and the longest wait for capacity (docs/guarantees.md "Capacity").
    max_sandboxes: int = 0
    max_sandboxes_per_org: int = 0
    admission_timeout_s: float = 600.0
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
    #: How long every commit has failed (0 after a commit went through).
    commits_failing_seconds: float = 0.0
    #: How long the loop stood still beyond the bounds of its broker waits (what liveness judges).
    seconds_stalled: float = 0.0
    #: The loop's bounded waits in progress, in words.
    waiting_for: str = ""


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
    joined: bool = False,
    stalled_s: float | None = None,
    waiting_for: str = "",
) -> Health:
    """Alive (liveness): the loop did not stand still for ``stall_after_s`` beyond the bounds of its
    broker waits (``stalled_s``, :mod:`~consumers.runtime.loop_watch`; the time since it turned when
    not given). Nothing else: a broker outage or a
    missing ACL fails the commits of every pod at once, and restarting them all would only add a
    state restore each; the loop retries every turn and carries on when the broker does.

    Ready (readiness): alive, commits not failing for ``stall_after_s``, and either the state of
    every assigned partition restored, or no partition assigned once the group is ``joined`` (an
    idle member: more replicas than partitions; it takes over when one leaves). Not ready keeps a
    rollout from going on while the new pods cannot commit.
    """
    since = now - last_loop
    stalled = since if stalled_s is None else stalled_s
    # Failing: no commit succeeded since the first failure, and they still fail (a pod that
    # failed and then had nothing to commit, e.g. its partitions moved away, is not failing).
    failing = stats.commits_failing_since
    still = now - stats.last_commit_failure < stall_after_s
    failing_for = now - failing if failing is not None and still else 0.0
    alive = running and stalled < stall_after_s
    serving = (restored and not restoring) if assigned > 0 else joined
    ready = alive and failing_for < stall_after_s and serving
    if not running:
        detail = "not running"
    elif stalled >= stall_after_s:
        detail = f"loop stalled for {stalled:.1f}s"
    elif failing_for >= stall_after_s:
        detail = f"commits failing for {failing_for:.1f}s"
    elif restoring:
        detail = "restoring state"
    elif assigned == 0:
        detail = "idle: no partitions assigned" if joined else "joining the group"
    elif not restored:
        detail = "taking partitions over"
    else:
        detail = "ok"
    return Health(alive, ready, restoring, assigned, since, detail, failing_for, stalled, waiting_for)


def with_membership(health: Health, joined: bool, stall_after_s: float) -> Health:
    """``health`` as :func:`assess_health` says it knowing whether the group is joined (the HTTP server
    reads that from the consumer): a joined member with no partitions, alive and committing, is ready."""
    if (
        not joined
        or health.assigned_partitions
        or not health.alive
        or health.restoring
        or health.commits_failing_seconds >= stall_after_s
    ):
        return health
    return replace(health, ready=True, detail="idle: no partitions assigned")
