"""The sandbox-lanes pod, in four layers (ARCHITECTURE.md; `lint-imports` enforces the order):

* ``lanes``   — the pure lane rules: (event, stored state, config) → (commands, new state, outcomes).
* ``runtime`` — the Kafka loop around them: consume, decide, transact, run driver calls, fold results.
* ``ops``     — how the pod is configured, wired, served and observed: settings, composition, HTTP, logs.
* ``tools``   — the CLI and what it runs besides the pod: demo, replay, reap, produce/tail, bench.

A layer imports only the layers listed before it.
"""
