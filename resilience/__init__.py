"""What every retry loop of the product shares: one bounded backoff and one episode log.

The lowest layer: it imports nothing of the product, so the pod's runtime and the drivers (which
may not import the pod) use the same primitive. Whether a failure is retried at all is not decided
here but in :mod:`consumers.runtime.failure_policy`.
"""
