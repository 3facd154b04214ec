"""The sandbox-lanes pod: pure lane rules, the stream runtime and the state store."""
