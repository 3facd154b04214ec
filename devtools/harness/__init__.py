"""Dev-only harness (not part of the product wheel): starters for a real Apache Kafka broker, a private
Docker engine, kube-apiserver + etcd, the Debian Python base image, and the protobuf generator.

Installed into the dev venv by ``scripts/bootstrap.sh`` (``pip install -e devtools``); the tests and
``sandbox-lanes bench`` use it.
"""
