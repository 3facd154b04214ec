"""The capacity ledger's instruments (docs/operations.md, metrics; issue 44 item 6).

Only the ledger's owner sets the gauges (one pod of the installation at a time); the other pods
report 0 for them, so a dashboard takes the ``max`` across pods.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Organisations named in ``sandbox_lanes_capacity_waiting{org}``: the most waiting first; the
#: rest are summed under ``org="other"`` (bounded cardinality, whatever the tenants).
MAX_ORG_LABELS = 20
OTHER_ORGS = "other"


class CapacityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.live = Gauge(
            "sandbox_lanes_capacity_live_sandboxes",
            "Sandboxes the capacity ledger counts against the caps now (ledger owner only)",
            registry=registry,
        )
        self.cap = Gauge(
            "sandbox_lanes_capacity_cap",
            "SANDBOX_LANES_MAX_SANDBOXES in force (0: no installation cap) (ledger owner only)",
            registry=registry,
        )
        self.waiting = Gauge(
            "sandbox_lanes_capacity_waiting",
            f"Creates waiting for capacity, by organisation (the {MAX_ORG_LABELS} with most waiting; "
            f'the rest as org="{OTHER_ORGS}") (ledger owner only)',
            ["org"],
            registry=registry,
        )
        self.admissions = Counter(
            "sandbox_lanes_capacity_admissions",
            "Creates the capacity ledger admitted",
            registry=registry,
        )
        self.timeouts = Counter(
            "sandbox_lanes_capacity_timeouts",
            "Creates that waited longer than SANDBOX_LANES_ADMISSION_TIMEOUT_S (failed, 'capacity: ...')",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "sandbox_lanes_capacity_wait_seconds",
            "How long an admitted create waited for capacity",
            buckets=(0.0, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=registry,
        )
        self._labelled: set[str] = set()

    def set_ledger(self, live: int, cap: int, waiting_by_org: Mapping[str, int]) -> None:
        self.live.set(live)
        self.cap.set(cap)
        ranked = sorted(waiting_by_org.items(), key=lambda item: (-item[1], item[0]))
        shown = dict(ranked[:MAX_ORG_LABELS])
        other = sum(n for _, n in ranked[MAX_ORG_LABELS:])
        if other:
            shown[OTHER_ORGS] = other
        for org in self._labelled - set(shown):
            self.waiting.remove(org)  # no longer waiting (or no longer among the top): its series ends
        for org, n in shown.items():
            self.waiting.labels(org).set(n)
        self._labelled = set(shown)

    def stood_down(self) -> None:
        """Not the owner any more: its gauges say nothing (another pod's do)."""
        self.set_ledger(0, 0, {})
