"""The agent-sandbox tier: one ``agents.x-k8s.io`` Sandbox per sandbox (``driver``), its pure manifests
(``manifests``), the idle sweep's settings and decision (``idle``), the warm pool's objects (``warm``)
and its claim path (``warm_pool``)."""
