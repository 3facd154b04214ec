"""The CLI (``sandbox-lanes``) and the tools it runs besides the pod: demo (embedded broker), replay
for audit, the reaper, produce/tail, bench.

May import every other layer. The bench starts its own broker and Docker engine only from a checkout
with the dev harness installed (``devtools/``, ``scripts/bootstrap.sh``); otherwise pass ``--bootstrap``.
"""
