"""The kubernetes tier: one Deployment, runner Secret and workspace PVC per sandbox (``driver``), built
as pure manifests (``manifests``). The agent-sandbox tier builds on its client plumbing."""
