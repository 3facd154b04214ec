"""Audit replay: re-derive every decision from the input topics and compare with what was recorded.

``sandbox-lanes replay --from-beginning | --from-offset N | --from-time T [--report FILE]``

How it works:

1. Snapshot the end offsets of the input topics and read them from the beginning
   (``read_committed`` under exactly-once), then read the outcome topic, the
   dead-letter topic and the compacted state topic as recorded.
2. Re-run the pure rules (:class:`consumers.runtime.processor.LaneProcessor` over
   :func:`consumers.lanes.rules.decide` / :func:`~consumers.lanes.rules.complete`) over the
   inputs in per-partition order (within a partition, by record timestamp, then
   topic, then offset), decoding each record exactly as the pod does.
3. Driver commands are answered by :class:`RecordedRunner` with the RECORDED
   result: the outcome with the command's deterministic event id (uuid5 of the
   input event id + outcome type + scope). No driver is built, no sandbox is
   touched; the state evolves exactly as it did in the pod (the session lane's
   ``status.error`` pre-stamp included).
4. Compare. A divergence is: a decision with no recorded outcome
   (``missing_outcome``); a recorded outcome with no decision
   (``unexpected_outcome``); a differing field (``field_mismatch``, outcome
   messages compared without ``meta.source``); two recorded outcomes with one id
   but different content (``conflicting_outcome``) or, under exactly-once, the
   same outcome twice (``duplicate_outcome``); an input dead-lettered by one side
   only or for another reason (``missing_dead_letter``, ``unexpected_dead_letter``,
   ``dead_letter_mismatch``, matched by source topic/partition/offset); a final
   execution state that differs from the compacted state topic (``state_mismatch``,
   ``unexpected_state``).

State is always re-derived from the beginning of the retained input; ``--from-offset``
and ``--from-time`` only narrow which decisions are compared. ``SandboxReaped`` outcomes
are the reaper's, not a decision of the inputs: they are counted, never compared.
Replay an idle pipeline for an exact answer: a running pod may record outcomes for
inputs newer than the snapshot (those are counted as ``after snapshot``, not diverged).
"""

from consumers.tools.replay.command import add_arguments, lane_config, run
from consumers.tools.replay.compare import Divergence, ReplayReport, Window
from consumers.tools.replay.derive import replay

__all__ = ["Divergence", "ReplayReport", "Window", "add_arguments", "lane_config", "replay", "run"]
