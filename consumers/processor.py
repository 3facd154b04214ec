"""One input event through the rules: decide → run commands → complete, and emit the logs.

This is the unit the stream runtime calls per record and the unit the seed
tests drive directly; it owns no Kafka and no driver of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from consumers.executor import CommandRunner
from consumers.rules import Decision, LaneConfig, LogIntent, Outcome, StateView, complete, decide
from events.codec import InputEvent

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def emit_logs(logger: logging.Logger, logs: tuple[LogIntent, ...], context: dict[str, str]) -> None:
    for intent in logs:
        logger.log(_LEVELS[intent.level], intent.message, extra={**context, **intent.fields})


@dataclass
class Processed:
    decision: Decision
    outcome: Outcome | None


@dataclass
class LaneProcessor:
    config: LaneConfig
    runner: CommandRunner
    logger: logging.Logger

    async def process(self, event: InputEvent, stored: StateView) -> Processed:
        decision = decide(event, stored, self.config)
        if decision.reject is not None or decision.duplicate or decision.state is None:
            return Processed(decision, None)
        results = [await self.runner.run(command) for command in decision.commands]
        outcome = complete(decision, results, self.config)
        context = {"driver": self.config.driver_name, "eventId": event.meta.event_id}
        emit_logs(self.logger, outcome.logs, context)
        return Processed(decision, outcome)
