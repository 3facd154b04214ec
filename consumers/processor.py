"""One input event through the rules: decide → run commands → complete, and emit the logs.

This is the unit the stream runtime calls per record and the unit the seed
tests drive directly; it owns no Kafka and no driver of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from consumers.executor import CommandRunner
from consumers.metrics import OUTCOME_WORDS, lane_of_command
from consumers.rules import Decision, LaneConfig, LogIntent, Outcome, StateView, complete, decide
from events.codec import InputEvent, record_key, type_name

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def emit_logs(logger: logging.Logger, logs: tuple[LogIntent, ...], context: dict[str, str]) -> None:
    for intent in logs:
        level = _LEVELS[intent.level]
        if logger.isEnabledFor(level):  # the same test logger.log makes, before the extra dict is built
            logger.log(level, intent.message, extra={**context, **intent.fields})


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
        logger = self.logger
        if outcome.logs:
            context = {"driver": self.config.driver_name, "eventId": event.meta.event_id}
            emit_logs(logger, outcome.logs, context)
        if not logger.isEnabledFor(logging.INFO):  # the per-decision line below would be dropped
            return Processed(decision, outcome)
        for command, output in zip(decision.commands, outcome.outputs, strict=False):
            kind = type_name(output).rsplit(".", 1)[-1]
            self.logger.info(
                "sandbox decision",
                extra={
                    "executionId": record_key(event),
                    "lane": lane_of_command(command),
                    "driver": self.config.driver_name,
                    "outcome": OUTCOME_WORDS.get(kind, kind),
                    "eventId": event.meta.event_id,
                },
            )
        return Processed(decision, outcome)
