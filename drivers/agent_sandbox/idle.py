"""The agent-sandbox idle sweep's settings and decision, pure (upstream ``config.ts``, ``idle-decision.ts``).

A Running session Sandbox whose session is idle for the window is suspended: its pod goes away,
its ``workspace`` claim stays, and the next ensure wakes the same Sandbox. The sweep never deletes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

SUSPEND_AFTER_OPTION: Final = "suspend_after_seconds"
SWEEP_INTERVAL_OPTION: Final = "sweep_interval_seconds"
SUSPEND_AFTER_ENV: Final = "STIGMER_SANDBOX_AGENT_SANDBOX_SUSPEND_AFTER_SECONDS"
SWEEP_INTERVAL_ENV: Final = "STIGMER_SANDBOX_AGENT_SANDBOX_SWEEP_INTERVAL_SECONDS"
DEFAULT_SUSPEND_AFTER_S: Final = 330
DEFAULT_SWEEP_INTERVAL_S: Final = 30
_WHOLE: Final = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class IdleConfig:
    suspend_after_s: int = DEFAULT_SUSPEND_AFTER_S
    sweep_interval_s: int = DEFAULT_SWEEP_INTERVAL_S


def _whole_seconds(env_name: str, raw: str | None, default: int) -> int:
    text = (raw or "").strip()
    if text == "":
        return default
    if not _WHOLE.fullmatch(text) or int(text) <= 0:
        raise ValueError(f"{env_name} must be a positive whole number of seconds, got {raw!r}")
    return int(text)


def idle_config(options: Mapping[str, str]) -> IdleConfig:
    """Boot validation: whole positive seconds (blank = default), the interval within the window."""
    window = _whole_seconds(SUSPEND_AFTER_ENV, options.get(SUSPEND_AFTER_OPTION), DEFAULT_SUSPEND_AFTER_S)
    interval = _whole_seconds(
        SWEEP_INTERVAL_ENV, options.get(SWEEP_INTERVAL_OPTION), DEFAULT_SWEEP_INTERVAL_S
    )
    if interval > window:
        raise ValueError(
            f"{SWEEP_INTERVAL_ENV} ({interval}) must not exceed {SUSPEND_AFTER_ENV} ({window}):"
            " a sandbox would stay up to an interval past its window"
        )
    return IdleConfig(suspend_after_s=window, sweep_interval_s=interval)


@dataclass(frozen=True)
class SessionActivity:
    """What the session's executions say: busy while any is not terminal; the latest stamp otherwise.

    ``executions == 0`` means the reader knows no execution of the session.
    """

    busy: bool
    last_active_at: float | None
    executions: int = 1


@dataclass(frozen=True)
class SandboxView:
    name: str
    running: bool
    deleting: bool
    created_at: float | None


def idle_clock(view: SandboxView, activity: SessionActivity, last_ensured_at: float | None) -> float | None:
    """When the session last counted as active: its latest stamp or this replica's last ensure,
    whichever is later; a Sandbox this replica never ensured counts from its creation."""
    floor = last_ensured_at if last_ensured_at is not None else view.created_at
    stamps = [t for t in (activity.last_active_at, floor) if t is not None]
    return max(stamps) if stamps else None


def should_suspend(
    now: float,
    window_s: float,
    view: SandboxView,
    activity: SessionActivity,
    last_ensured_at: float | None,
) -> bool:
    if view.deleting or not view.running or activity.busy:
        return False
    clock = idle_clock(view, activity, last_ensured_at)
    return clock is not None and now - clock >= window_s
