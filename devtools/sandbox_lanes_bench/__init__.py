"""``sandbox-lanes bench``: the pod measured against the plain aiokafka pipe on the same broker.

Figures (every one bounded, repeated ``--repeats`` times, reported as median and min-max):

1. ``ceiling``  — a plain aiokafka consume→produce pipe (no decode, no rules, no transaction) over the
   same pre-produced ``ExecutionCreated`` records and the same topic settings: the most this stack
   does on this machine. Also ``ceiling_eos_x2``: the same pipe with the pod's write shape (one
   Kafka transaction per batch, two records written per input, offsets in the transaction).
2. ``pod``      — the pod (in this process) with the counting in-memory driver, ``exactly_once`` and
   ``at_least_once``: input events/s and the ratio pod / ceiling.
3. ``latency``  — produce ``ExecutionCreated`` → consume ``SandboxProvisioned`` (read_committed),
   p50/p95/p99 at a fixed offered load (``--latency-load`` x the measured pod throughput); the load
   generator and the collector run in a child process so they do not share the pod's event loop.
4. ``rules``    — pure ``decide`` + ``complete`` per input event, no I/O, one core.
5. ``restore``  — state-store restore from the compacted topic for 10k/100k/1M executions, in a child
   process (its peak RSS is the restore's own, from ``VmHWM``); beside it, Quix Streams restoring the
   same number of keys (up to 100k) from its changelog (``peers_restore``, the ``[bench]`` extra).
6. ``drivers``  — ensure (absent → running) and re-ensure (running → fast path) latency of the
   local-process driver (``consumers/tools/stub_runner.py``) and the docker driver (a private dockerd from
   ``devtools/harness/dockerd.py`` with the imported busybox image). A driver that cannot start is reported as
   an error in its row; the other figures still run.
7. ``burst``    — time to sandbox: N workflow creates at once through the pod with the memory driver
   at an injected latency, and with the docker driver next to the raw engine's own time for the
   same containers (``devtools/sandbox_lanes_bench/burst.py``). Not in the default set (``--only burst``).
8. ``peers``    — the pod next to Quix Streams, faust and confluent-kafka on the same job
   (``devtools/sandbox_lanes_bench/peers_figure.py``).
9. ``retention`` — bounded state: waves of workflow executions (create → COMPLETED) through a pod
   with a short ``SANDBOX_LANES_STATE_RETENTION_S`` and through one that keeps every state; per wave
   keys held, the pod's RSS and store bytes, and a fresh restore of the state topic, side by side as
   ratios to the first wave (``devtools/sandbox_lanes_bench/retention.py``). Not in the default set
   (``--only retention``).
10. ``soak``    — cost over time: a pod on a three-node cluster of its own, a steady stream of executions
   that end, retention scaled down, a broker bounced every few minutes; RSS, threads, descriptors,
   asyncio tasks, states held, lag and latency sampled every second, their slopes after the warm-up
   (``devtools/sandbox_lanes_bench/soak.py``; ``--only soak --minutes N``, not in the default set).

Without ``--bootstrap`` a fresh Apache Kafka broker (``devtools/harness/kafka_broker.py``) is started and
stopped. The table is printed as markdown; ``--out`` gets the JSON (figures + machine + versions).
"""

from sandbox_lanes_bench.runner import add_arguments, run

__all__ = ["add_arguments", "run"]
