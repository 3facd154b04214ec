"""The Kafka runtime: the consume → decide → transact loop, the outbox's effect runner, the
per-partition transactional sinks, the compacted state store, the topic names, the pod's metrics.

May import: ``consumers.lanes``, ``events``, ``drivers``. Never ``consumers.ops`` or ``consumers.tools``
(settings arrive as plain values; the runtime does not read the environment).
"""
