"""Spec rules the seed file does not pin but the spec states (sections 1.2, 2.1, 2.3, 2.5, 3.3, 3.4, 4.1).

Same model as tests/unit/test_seed_steps.py: an input event and the stored state go in;
driver calls, the new state, outcome events and log lines come out.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import logging

import pytest

from consumers.lanes.commands import StateView
from consumers.lanes.constants import (
    LOG_SESSION_DEPROVISION_FAILED,
    LOG_SESSION_PROVISIONING_FAILED,
    LOG_WORKFLOW_PROVISIONING_FAILED,
)
from consumers.lanes.credentials import SandboxCredentialRequest
from consumers.ops.compose import build_provisioner
from consumers.ops.settings import ConfigError, load_settings
from consumers.runtime.runner_tokens import (
    ExecutionScopedRunnerCredentialProvider,
    InvalidTokenError,
    mint_sandbox_token,
)
from events.sandbox_lanes.v1 import common_pb2, outcomes_pb2
from tests.support.lane_fakes import CapabilityCredentials, FakeProvisioner, lane_processor
from tests.unit.test_seed_steps import seed, session_deleted, workflow_execution

KEY = bytes(range(32))


def _records(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == message]


# --- 2.1 the session lane --------------------------------------------------------------------------


async def test_an_agent_execution_without_a_session_is_skipped_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    execution.session_id = ""
    with caplog.at_level(logging.DEBUG, logger="sandbox_lanes.test"):
        processed = await lane_processor(provisioner).process(execution, StateView(None))
    assert provisioner.ensured == []
    assert processed.outcome is None or processed.outcome.outputs == ()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_mint_failure_is_pre_stamped_like_a_driver_failure_and_logged_with_the_upstream_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class RefusingCapability(CapabilityCredentials):
        def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
            raise PermissionError("creator stamp not resolvable")

    provisioner = FakeProvisioner()
    session_id, execution = seed(common_pb2.CLOUD)
    with caplog.at_level(logging.ERROR, logger="sandbox_lanes.test"):
        processed = await lane_processor(provisioner, RefusingCapability()).process(
            execution, StateView(None)
        )
    assert provisioner.ensured == [], "a failed mint never reaches the driver"
    assert processed.outcome is not None and processed.outcome.state is not None
    assert processed.outcome.state.status_error == "Sandbox provisioning failed: creator stamp not resolvable"
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and not failed.critical
    (line,) = _records(caplog, LOG_SESSION_PROVISIONING_FAILED)
    assert LOG_SESSION_PROVISIONING_FAILED == (
        "Session sandbox provisioning failed - execution will time out unless a runner polls its queue"
    )
    assert line.levelno == logging.ERROR
    assert (line.executionId, line.sessionId, line.error) == (  # type: ignore[attr-defined]
        execution.execution_id,
        session_id,
        "creator stamp not resolvable",
    )


async def test_the_caller_class_reaches_the_driver_unchanged() -> None:
    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    execution.caller_class = "guest"
    await lane_processor(provisioner).process(execution, StateView(None))
    (ensured,) = provisioner.ensured
    assert ensured.env.caller_class == "guest"
    workflow = FakeProvisioner()
    event = workflow_execution(common_pb2.CLOUD, "wfx_caller_class")
    event.caller_class = "member"
    await lane_processor(workflow).process(event, StateView(None))
    assert workflow.ensured[0].env.caller_class == "member"


# --- 2.3 / 2.5 the failure log lines ---------------------------------------------------------------


async def test_a_workflow_provisioning_failure_logs_the_upstream_refusal_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner(ensure_error=RuntimeError("no capacity"))
    with caplog.at_level(logging.ERROR, logger="sandbox_lanes.test"):
        await lane_processor(provisioner).process(
            workflow_execution(common_pb2.CLOUD, "wfx_refused"), StateView(None)
        )
    (line,) = _records(caplog, LOG_WORKFLOW_PROVISIONING_FAILED)
    assert LOG_WORKFLOW_PROVISIONING_FAILED == "Workflow sandbox provisioning failed - refusing the request"
    assert (line.executionId, line.error) == ("wfx_refused", "no capacity")  # type: ignore[attr-defined]


async def test_a_session_teardown_failure_logs_the_upstream_leak_line_with_the_session_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provisioner = FakeProvisioner(deprovision_error=RuntimeError("engine gone"))
    with caplog.at_level(logging.ERROR, logger="sandbox_lanes.test"):
        await lane_processor(provisioner).process(session_deleted("ses_leaky"), StateView(None))
    (line,) = _records(caplog, LOG_SESSION_DEPROVISION_FAILED)
    assert LOG_SESSION_DEPROVISION_FAILED == "Session sandbox deprovision failed - sandbox may be leaked"
    assert line.levelno == logging.ERROR
    assert (line.sessionId, line.error) == ("ses_leaky", "engine gone")  # type: ignore[attr-defined]


# --- 1.2 the boot coherence guard ------------------------------------------------------------------


def test_a_driver_with_neither_per_queue_routing_mode_is_boot_fatal(tmp_path: object) -> None:
    settings = load_settings(
        {
            "SANDBOX_PROVISIONER_TYPE": "local-process",
            "STIGMER_ACTIVITY_ROUTING": "global",
            "STIGMER_WORKFLOW_ACTIVITY_ROUTING": "global",
            "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={tmp_path}",
        }
    )
    with pytest.raises(ConfigError) as refused:
        build_provisioner(settings, logging.getLogger("sandbox_lanes.test"))
    assert str(refused.value).startswith(
        "SANDBOX_PROVISIONER_TYPE='local-process' requires a per-queue routing mode"
    )
    # Either mode alone passes boot (the session lane's warn arm stays reachable, spec 9).
    for agent, workflow in (("session", "global"), ("global", "execution")):
        ok = load_settings(
            {
                "SANDBOX_PROVISIONER_TYPE": "local-process",
                "STIGMER_ACTIVITY_ROUTING": agent,
                "STIGMER_WORKFLOW_ACTIVITY_ROUTING": workflow,
                "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={tmp_path}",
            }
        )
        assert build_provisioner(ok, logging.getLogger("sandbox_lanes.test")) is not None


# --- 3.3 the mint decision: a capability's "" is its decision ---------------------------------------


async def test_a_capability_returning_empty_launches_token_less_without_consulting_the_primitives() -> None:
    class TokenLessCapability(CapabilityCredentials):  # primitives raise if consulted
        def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
            self.minted.append(request)
            return ""

    credentials = TokenLessCapability()
    request = SandboxCredentialRequest("session", "ses_1", "axr_1", "org", "")
    token = await mint_sandbox_token(credentials, request, logging.getLogger("sandbox_lanes.test"))  # type: ignore[arg-type]
    assert token == "" and credentials.minted == [request]

    provisioner = FakeProvisioner()
    _, execution = seed(common_pb2.CLOUD)
    processed = await lane_processor(provisioner, TokenLessCapability()).process(execution, StateView(None))
    assert provisioner.ensured[0].env.stigmer_token == ""
    assert processed.outcome is not None
    (provisioned,) = processed.outcome.outputs
    assert isinstance(provisioned, outcomes_pb2.SandboxProvisioned) and not provisioned.token_minted


# --- 3.4 verify order, fail closed -------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _signed(claims: object) -> str:
    """A token signed with KEY over any body: only a key holder can make these."""
    header = _b64(b'{"alg":"HS256","typ":"JWT"}')
    body = _b64(json.dumps(claims).encode())
    signature = _b64(hmac.new(KEY, f"{header}.{body}".encode(), hashlib.sha256).digest())
    return f"{header}.{body}.{signature}"


class _At(dt.datetime):
    instant = 1_800_000_000

    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> _At:  # type: ignore[override]
        return cls.fromtimestamp(cls.instant, tz)


def test_verify_rejects_every_signed_claim_set_the_spec_rules_out() -> None:
    verifier = ExecutionScopedRunnerCredentialProvider(KEY, now=_At)
    exp = _At.instant + 60
    good = {"token_type": "execution_scoped", "execution_id": "axr_1", "iat": _At.instant, "exp": exp}
    assert verifier.verify("execution_scoped", _signed(good)) == "axr_1"
    for bad in (
        {**good, "token_type": "run_credential"},
        {**good, "execution_id": ""},
        {k: v for k, v in good.items() if k != "execution_id"},
        {**good, "exp": _At.instant},  # invalid once now >= exp
        {**good, "exp": str(exp)},
        ["execution_scoped", "axr_1"],  # a body that is not a JSON object
        "axr_1",
    ):
        with pytest.raises(InvalidTokenError, match="invalid runner token"):
            verifier.verify("execution_scoped", _signed(bad))
    with pytest.raises(InvalidTokenError):
        verifier.verify("another_lane", _signed(good))


# --- the error text, the mint's type and the ensure bound (issue 11 item 8) ------------------------


async def test_an_error_with_an_empty_message_pre_stamps_the_bare_prefix() -> None:
    """Upstream stamps the prefix + the error's message; an empty message leaves the bare prefix."""
    provisioner = FakeProvisioner(ensure_error=RuntimeError(""))
    _, execution = seed(common_pb2.CLOUD)
    processed = await lane_processor(provisioner).process(execution, StateView(None))
    assert processed.outcome is not None and processed.outcome.state is not None
    assert processed.outcome.state.status_error == "Sandbox provisioning failed: "


class _Returning(CapabilityCredentials):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:
        return self.value  # type: ignore[return-value]


@pytest.mark.parametrize("value", [None, 42, b"bytes-token"])
async def test_a_credential_provider_returning_a_non_string_fails_the_ensure(value: object) -> None:
    provisioner = FakeProvisioner()
    processed = await lane_processor(provisioner, _Returning(value)).process(
        workflow_execution(common_pb2.CLOUD), StateView(None)
    )
    assert provisioner.ensured == []  # the driver is never called with it
    assert processed.outcome is not None
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and failed.critical
    assert "not a string" in failed.reason and type(value).__name__ in failed.reason


async def test_the_mint_runs_inside_the_ensure_bound_and_a_drivers_own_timeout_keeps_its_message() -> None:
    import asyncio

    from consumers.runtime.executor import DriverExecutor
    from consumers.runtime.processor import LaneProcessor

    class Hanging(CapabilityCredentials):
        async def mint_sandbox_credential(self, request: SandboxCredentialRequest) -> str:  # type: ignore[override]
            await asyncio.sleep(30)
            return "never"

    log = logging.getLogger("sandbox_lanes.test")
    config = lane_processor(FakeProvisioner()).config
    hung = DriverExecutor(FakeProvisioner(), Hanging(), log, ensure_timeout_s=0.2)  # type: ignore[arg-type]
    processed = await LaneProcessor(config, hung, log).process(
        workflow_execution(common_pb2.CLOUD), StateView(None)
    )
    assert processed.outcome is not None
    (failed,) = processed.outcome.outputs
    assert (
        isinstance(failed, outcomes_pb2.SandboxFailed)
        and failed.reason == "sandbox ensure timed out after 0.2s"
    )

    own = DriverExecutor(
        FakeProvisioner(ensure_error=TimeoutError("engine read timed out")), CapabilityCredentials(), log
    )  # type: ignore[arg-type]
    processed = await LaneProcessor(config, own, log).process(
        workflow_execution(common_pb2.CLOUD), StateView(None)
    )
    assert processed.outcome is not None
    (failed,) = processed.outcome.outputs
    assert isinstance(failed, outcomes_pb2.SandboxFailed) and failed.reason == "engine read timed out"
