"""The topology's plan: which topics a configuration needs, with which partitions and settings."""

from __future__ import annotations

from consumers.runtime.kafka.topology import Topics, plan_topics


def test_a_cap_adds_the_capacity_ledgers_topics_and_the_pod_reads_its_answers() -> None:
    off = Topics(state="s")
    assert off.consumed == off.inputs and "s-admissions" not in off.all()
    on = Topics(state="s", capacity_on=True)
    assert on.consumed == (*on.inputs, "s-admissions")
    assert on.co_partitioned == (*on.inputs, "s-admissions", "s")  # the answers share the inputs' count
    plan = {spec.name: spec for spec in plan_topics(on, 6)}
    assert (plan["s-admissions"].partitions, plan["s-admissions"].single) == (6, False)
    for name in ("s-capacity", "s-capacity-ledger"):  # one order for the whole installation
        assert (plan[name].partitions, plan[name].single, plan[name].owned) == (1, True, True)
    assert plan["s-capacity-ledger"].configs["cleanup.policy"] == "compact"
    assert plan["s-capacity"].configs["retention.ms"] == "-1"  # replay decides it from its first record
    assert {spec.name for spec in plan_topics(off, 6)} == set(off.all()) | {off.lane_config}
