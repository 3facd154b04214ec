"""Shared pytest wiring: the real parts (Kafka, dockerd, kube-apiserver) are session fixtures."""

pytest_plugins = [
    "tests.fixtures.kafka",
    "tests.fixtures.dockerd",
    "tests.fixtures.kube",
]
