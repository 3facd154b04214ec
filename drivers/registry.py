"""Name → factory selection (upstream ``newSandboxProvisioner``).

Built-ins first, then extensions registered through the ``sandbox_lanes.drivers``
entry-point group (the Python convention for plug-ins); an extension may not
take a built-in name. ``""`` selects nothing: the lane is disabled. Only the
selected factory is called.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from importlib.metadata import entry_points

from drivers.contract import DriverConfig, SandboxProvisioner, SandboxProvisionerFactory

ENTRY_POINT_GROUP = "sandbox_lanes.drivers"

#: DD-002's isolation ladder, weakest to strongest; values are "module:factory".
BUILT_IN_SANDBOX_PROVISIONER_TYPES: Mapping[str, str] = {
    "local-process": "drivers.local_process:new_local_process_provisioner",
    "docker": "drivers.docker:new_docker_provisioner",
    "kubernetes": "drivers.kubernetes.driver:new_kubernetes_provisioner",
    # Upstream's Era D replaced kubernetes with agent-sandbox; both are kept here (docs/rules.md: Deviations).
    "agent-sandbox": "drivers.agent_sandbox.driver:new_agent_sandbox_provisioner",
}


_KUBE_OPTIONS = frozenset(
    {
        "kubeconfig",
        "kubeconfig_context",
        "request_timeout",
        "max_pool_size",
        "admission_wait_seconds",
        "storage_size",
        "storage_class",
        "cpu_request",
        "memory_request",
        "cpu_limit",
        "memory_limit",
    }
)
#: The ``SANDBOX_LANES_DRIVER_OPTIONS`` keys each built-in reads (its module docstring and
#: docs/drivers.md's table say what they mean): any other key is a typo the settings refuse,
#: never silently ignored.
#: ``tests/test_config.py`` checks this table against the keys the drivers' sources read.
BUILT_IN_OPTION_KEYS: Mapping[str, frozenset[str]] = {
    "local-process": frozenset({"state_dir", "grace_seconds"}),
    "docker": frozenset(
        {
            "docker_host",
            "api_version",
            "timeout",
            "image",
            "entrypoint",
            "command",
            "memory",
            "cpus",
            "pids_limit",
            "network",
            "hardened",
            "read_only",
            "max_pool_size",
        }
    ),
    "kubernetes": _KUBE_OPTIONS,
    "agent-sandbox": _KUBE_OPTIONS
    | {
        "warm_pool_size",
        "warm_assignment",
        "warm_adopt_timeout_seconds",
        "suspend_after_seconds",
        "sweep_interval_seconds",
    },
}


def option_keys(provisioner_type: str) -> frozenset[str] | None:
    """The option keys a driver reads; ``None`` when not declared (an extension: its keys pass)."""
    return BUILT_IN_OPTION_KEYS.get(provisioner_type)


class UnknownProvisionerError(ValueError):
    """Boot-fatal: the configured driver name is not known."""


def _load(target: str) -> SandboxProvisionerFactory:
    module_name, _, attr = target.partition(":")
    factory: SandboxProvisionerFactory = getattr(importlib.import_module(module_name), attr)
    return factory


def extension_factories() -> dict[str, str]:
    """Factories registered by installed distributions, as "module:attr" targets."""
    found: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILT_IN_SANDBOX_PROVISIONER_TYPES:
            raise ValueError(f"sandbox provisioner extension may not register the built-in name '{ep.name}'")
        found[ep.name] = ep.value
    return found


def known_types(extensions: Mapping[str, object] | None = None) -> list[str]:
    names = set(BUILT_IN_SANDBOX_PROVISIONER_TYPES)
    names.update(extension_factories() if extensions is None else extensions)
    return sorted(names)


def new_sandbox_provisioner(
    provisioner_type: str,
    config: DriverConfig,
    logger: logging.Logger,
    extensions: Mapping[str, SandboxProvisionerFactory] | None = None,
    built_ins: Mapping[str, SandboxProvisionerFactory] | None = None,
) -> SandboxProvisioner | None:
    """Build the selected driver, or ``None`` for ``""`` (the external-runner posture).

    ``built_ins`` replaces the built-in table (upstream passes both maps, so its
    selection tests inject fakes for either); by default the real built-ins are
    imported lazily, only the selected one.
    """
    if provisioner_type == "":
        return None
    reserved = BUILT_IN_SANDBOX_PROVISIONER_TYPES if built_ins is None else built_ins
    for name in extensions or {}:
        if name in reserved:
            raise ValueError(f"sandbox provisioner extension may not register the built-in name '{name}'")
    if built_ins is not None and provisioner_type in built_ins:
        factory = built_ins[provisioner_type]
    elif built_ins is None and provisioner_type in BUILT_IN_SANDBOX_PROVISIONER_TYPES:
        factory = _load(BUILT_IN_SANDBOX_PROVISIONER_TYPES[provisioner_type])
    elif extensions is not None and provisioner_type in extensions:
        factory = extensions[provisioner_type]
    else:
        registered = extension_factories() if extensions is None else {}
        if provisioner_type in registered:
            factory = _load(registered[provisioner_type])
        else:
            ext_names = extensions if extensions is not None else registered
            names = known_types(ext_names) if built_ins is None else sorted({*built_ins, *ext_names})
            listed = ", ".join(f"'{n}'" for n in names)
            raise UnknownProvisionerError(
                f"unknown sandbox provisioner type '{provisioner_type}' — known types: {listed}"
            )
    return factory(config, logger)
