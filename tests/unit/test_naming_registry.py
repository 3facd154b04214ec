"""Selection and naming contracts (port of upstream provisioner.test.ts)."""

from __future__ import annotations

import logging
import re
from typing import cast

import pytest
from harness.memory_driver import MemoryProvisioner

from drivers.contract import SCOPES, DriverConfig, SandboxProvisioner, SandboxProvisionerFactory, SandboxScope
from drivers.naming import (
    LABEL_INSTALLATION,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_SCOPE,
    MANAGED_BY_VALUE,
    is_owned_by,
    managed_selector,
    sandbox_base_name,
    sandbox_labels,
    valid_installation,
)
from drivers.registry import (
    BUILT_IN_SANDBOX_PROVISIONER_TYPES,
    UnknownProvisionerError,
    new_sandbox_provisioner,
)

LOGGER = logging.getLogger("tests.registry")
CONFIG = DriverConfig(
    backend_endpoint="http://host.docker.internal:7234",
    temporal_address="host.docker.internal:7233",
)


class Marker:
    def __init__(self) -> None:
        self.constructed = 0

    def factory(self) -> SandboxProvisionerFactory:
        def build(config: DriverConfig, logger: logging.Logger) -> SandboxProvisioner:
            self.constructed += 1
            return MemoryProvisioner(name="fake")

        return build


# -- newSandboxProvisioner selection ----------------------------------------------


def test_empty_type_selects_nothing_the_external_runner_default() -> None:
    assert new_sandbox_provisioner("", CONFIG, LOGGER, extensions={}, built_ins={}) is None
    assert new_sandbox_provisioner("", CONFIG, LOGGER) is None


def test_an_unknown_type_is_a_loud_boot_throw_naming_the_known_set() -> None:
    marker = Marker()
    with pytest.raises(UnknownProvisionerError) as err:
        new_sandbox_provisioner(
            "daytona",
            CONFIG,
            LOGGER,
            built_ins={"docker": marker.factory()},
            extensions={"fly-machines": marker.factory()},
        )
    assert (
        str(err.value) == "unknown sandbox provisioner type 'daytona' — known types: 'docker', 'fly-machines'"
    )
    assert marker.constructed == 0, "no factory may run on a failed selection"


def test_an_unknown_type_against_the_real_built_ins_lists_them_sorted_with_extensions() -> None:
    marker = Marker()
    with pytest.raises(UnknownProvisionerError) as err:
        new_sandbox_provisioner("daytona", CONFIG, LOGGER, extensions={"fly-machines": marker.factory()})
    assert str(err.value) == (
        "unknown sandbox provisioner type 'daytona' — known types: "
        "'agent-sandbox', 'docker', 'fly-machines', 'kubernetes', 'local-process'"
    )
    assert marker.constructed == 0


def test_selects_a_built_in_factory_and_constructs_it_exactly_once() -> None:
    marker = Marker()
    provisioner = new_sandbox_provisioner(
        "docker", CONFIG, LOGGER, built_ins={"docker": marker.factory()}, extensions={}
    )
    assert provisioner is not None
    assert marker.constructed == 1


def test_selects_the_real_built_in_drivers_by_name() -> None:
    local = new_sandbox_provisioner("local-process", CONFIG, LOGGER, extensions={})
    assert local is not None and local.driver_name == "local-process"
    docker = new_sandbox_provisioner("docker", CONFIG, LOGGER, extensions={})
    assert docker is not None and docker.driver_name == "docker"


def test_the_dev_harness_registers_the_memory_driver_by_entry_point() -> None:
    # Not a built-in: the harness distribution's `sandbox_lanes.drivers` entry point (devtools/pyproject.toml).
    assert "memory" not in BUILT_IN_SANDBOX_PROVISIONER_TYPES
    memory = new_sandbox_provisioner("memory", DriverConfig(options={"seed": "3"}), LOGGER)
    assert isinstance(memory, MemoryProvisioner) and memory.seed == 3


def test_selects_an_extension_registered_factory_beyond_the_built_ins() -> None:
    marker = Marker()
    provisioner = new_sandbox_provisioner(
        "fly-machines", CONFIG, LOGGER, built_ins={}, extensions={"fly-machines": marker.factory()}
    )
    assert provisioner is not None
    assert marker.constructed == 1


def test_an_extension_may_not_shadow_a_built_in_name() -> None:
    marker = Marker()
    with pytest.raises(ValueError, match="may not register the built-in name 'docker'"):
        new_sandbox_provisioner("docker", CONFIG, LOGGER, extensions={"docker": marker.factory()})
    assert marker.constructed == 0


def test_an_unselected_driver_constructs_nothing() -> None:
    selected, bystander = Marker(), Marker()
    new_sandbox_provisioner(
        "docker",
        CONFIG,
        LOGGER,
        built_ins={"docker": selected.factory(), "kubernetes": bystander.factory()},
        extensions={},
    )
    assert selected.constructed == 1
    assert bystander.constructed == 0


def test_the_built_in_name_set_is_the_isolation_ladder() -> None:
    assert list(BUILT_IN_SANDBOX_PROVISIONER_TYPES) == [
        "local-process",
        "docker",
        "kubernetes",
        "agent-sandbox",
    ]


# -- sandbox_base_name (the Java SandboxObjectNaming derivation) -------------------


def test_base_name_is_deterministic_per_scope_and_id_and_distinct_across_scopes() -> None:
    a = sandbox_base_name("session", "ses_01ABC")
    assert a == sandbox_base_name("session", "ses_01ABC")
    assert a != sandbox_base_name("workflow", "ses_01ABC")
    assert a != sandbox_base_name("session", "ses_01ABD")
    names = {sandbox_base_name(scope, "same_id") for scope in SCOPES}
    assert len(names) == 3


@pytest.mark.parametrize(("scope", "code"), [("session", "ses"), ("workflow", "wfx"), ("connect", "mcp")])
def test_base_name_has_the_sbx_code_12hex_shape_dns_safe(scope: str, code: str) -> None:
    name = sandbox_base_name(cast(SandboxScope, scope), "wfx_01J_UNDERSCORED.id")
    assert re.fullmatch(rf"sbx-{code}-[0-9a-f]{{12}}", name)
    assert re.fullmatch(r"^sbx-(ses|wfx|mcp)-[0-9a-f]{12}$", name)
    assert len(name) <= 63


def test_base_name_matches_the_vectors_the_runner_attach_waiter_pins() -> None:
    assert sandbox_base_name("session", "ses_01m3zkdb7wxbe2gx0ezmf8fmaq") == "sbx-ses-4e918096d317"
    assert sandbox_base_name("workflow", "wfx_01m3zk8zjqdj5jsep1zngaawxq") == "sbx-wfx-6406dd0a36ee"
    assert sandbox_base_name("connect", "aex_01m3zkdb6zbg983x4yvttsysyy") == "sbx-mcp-aa8898c8a32c"


def test_labels_carry_the_reap_filter_installation_scope_and_full_id() -> None:
    assert sandbox_labels("workflow", "wfx_01J_UNDERSCORED.id", "staging") == {
        LABEL_MANAGED_BY: MANAGED_BY_VALUE,
        LABEL_INSTALLATION: "staging",
        LABEL_SCOPE: "workflow",
        LABEL_SANDBOX_ID: "wfx_01J_UNDERSCORED.id",
    }
    assert LABEL_MANAGED_BY == "stigmer.ai/managed-by" and MANAGED_BY_VALUE == "stigmer-server"
    assert LABEL_INSTALLATION == "stigmer.ai/installation"
    assert (
        managed_selector("staging") == "stigmer.ai/managed-by=stigmer-server,stigmer.ai/installation=staging"
    )


def test_an_object_is_a_sandbox_s_only_with_its_id_scope_and_installation() -> None:
    labels = sandbox_labels("workflow", "wfx_1", "production")
    assert is_owned_by(labels, "workflow", "wfx_1", "production")
    assert not is_owned_by(labels, "workflow", "wfx_1", "staging")  # another installation's
    assert not is_owned_by(labels, "workflow", "wfx_2", "production")  # another id's (a collision)
    assert not is_owned_by(labels, "session", "wfx_1", "production")
    unlabelled = {k: v for k, v in labels.items() if k != LABEL_INSTALLATION}
    assert not is_owned_by(unlabelled, "workflow", "wfx_1", "production")  # made before installations
    assert not is_owned_by({}, "workflow", "wfx_1", "production")


@pytest.mark.parametrize("good", ["sandbox-lanes", "prod", "a", "Staging_2.eu", "x" * 63])
def test_an_installation_is_a_label_value(good: str) -> None:
    assert valid_installation(good) == good


@pytest.mark.parametrize("bad", ["", "-prod", "prod-", "a/b", "x" * 64, "with space"])
def test_an_installation_that_cannot_be_a_label_value_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not usable as a label value"):
        valid_installation(bad)
