"""The runner environment contract shared by the built-in drivers (spec 5.1, 5.2).

Every driver hands its runner the same facts: the queue to poll, the endpoints,
the Temporal namespace, the operator's runner settings and secrets, the rendered
Temporal connection settings and (only when one was minted) the token. The
drivers differ only in *where* the values go (a child's env, a container's env),
so the content is built once here.

Secrets are kept apart from plain values so a driver can route them through a
secret channel and so nothing here ever needs to log a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from drivers.contract import SANDBOX_DRIVER_OWNED_RUNNER_ENV, DriverConfig, SandboxEnvironment

#: Prefixes of the server's own Temporal connection settings. An inherited
#: ``..._PATH`` item must never sit next to its rendered ``..._DATA`` twin
#: (the runner refuses to boot), so a child never inherits any of these.
TEMPORAL_CONNECTION_ENV_PREFIXES: Final[tuple[str, ...]] = ("STIGMER_TEMPORAL_", "TEMPORAL_")

TOKEN_ENV: Final = "STIGMER_TOKEN"

_DRIVER_OWNED: Final[frozenset[str]] = frozenset(SANDBOX_DRIVER_OWNED_RUNNER_ENV)


def is_temporal_connection_name(name: str) -> bool:
    return name.startswith(TEMPORAL_CONNECTION_ENV_PREFIXES)


def inheritable_parent_env(
    parent: Mapping[str, str], withheld: frozenset[str] = frozenset()
) -> dict[str, str]:
    """The part of the server's env a local child may inherit.

    Drops the Temporal connection settings (spec 5.1), every driver-owned name, so a
    conditional variable such as ``STIGMER_TOKEN`` is present in the child only when the
    driver itself sets it, and the pod's own secrets (``withheld``: upstream passes its whole
    environment on, signing key included; a runner holding it could mint any execution's token).
    """
    return {
        k: v
        for k, v in parent.items()
        if not is_temporal_connection_name(k) and k not in _DRIVER_OWNED and k not in withheld
    }


def _operator_entries(values: Mapping[str, str]) -> dict[str, str]:
    # The config loader refuses driver-owned names in the operator's lists; the
    # drivers drop them too, so a misconfiguration can never smuggle a token.
    return {k: v for k, v in values.items() if k not in _DRIVER_OWNED}


@dataclass(frozen=True)
class RunnerEnv:
    """The contract for one sandbox, split by sensitivity. ``repr`` never shows values."""

    plain: dict[str, str] = field(default_factory=dict, repr=False)
    secret: dict[str, str] = field(default_factory=dict, repr=False)

    def merged(self) -> dict[str, str]:
        return {**self.plain, **self.secret}

    def secret_values(self) -> list[str]:
        """Non-empty secret values, for scrubbing engine error texts."""
        return [v for v in self.secret.values() if v]

    def names(self) -> list[str]:
        return sorted(self.merged())


def build_runner_env(
    config: DriverConfig,
    env: SandboxEnvironment,
    *,
    workspace_dir: str,
    home: str | None = None,
) -> RunnerEnv:
    """Operator overlays first, then the driver-owned values (which therefore always win).

    * plain: runner_env, ``MODE=local``, ``STIGMER_TASK_QUEUE``, ``WORKSPACE_ROOT_DIR``,
      ``TEMPORAL_NAMESPACE``, ``HOME`` (if given) and the endpoints, each only if non-empty;
    * secret: runner_secret_env, temporal_connection_env and ``STIGMER_TOKEN`` only if minted.
    """
    plain: dict[str, str] = dict(_operator_entries(config.runner_env))
    secret: dict[str, str] = dict(_operator_entries(config.runner_secret_env))
    secret.update(_operator_entries(config.temporal_connection_env))
    for name in secret:
        plain.pop(name, None)

    plain["MODE"] = "local"
    plain["STIGMER_TASK_QUEUE"] = env.task_queue
    plain["WORKSPACE_ROOT_DIR"] = workspace_dir
    plain["TEMPORAL_NAMESPACE"] = config.temporal_namespace
    if home is not None:
        plain["HOME"] = home
    if config.backend_endpoint:
        plain["STIGMER_BACKEND_ENDPOINT"] = config.backend_endpoint
    if config.temporal_address:
        plain["TEMPORAL_SERVICE_ADDRESS"] = config.temporal_address
    if config.mcp_public_endpoint:
        plain["STIGMER_MCP_PUBLIC_ENDPOINT"] = config.mcp_public_endpoint
    if env.stigmer_token:
        secret[TOKEN_ENV] = env.stigmer_token
    return RunnerEnv(plain=plain, secret=secret)


def scrub(text: str, secrets: list[str]) -> str:
    """Replace every secret value in ``text`` (longest first) with a marker."""
    for value in sorted(set(secrets), key=len, reverse=True):
        if value:
            text = text.replace(value, "[redacted]")
    return text
