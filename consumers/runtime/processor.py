"""One input event through the rules, and the logs they ask for.

Two paths over the same pure rules. :meth:`LaneProcessor.process` decides, runs
the commands and completes at once (the seed tests and the audit replay drive it).
The pod splits it: :meth:`LaneProcessor.decide` in the decision's transaction,
the driver call off it (:mod:`consumers.runtime.effects`), :meth:`LaneProcessor.complete`
in a later transaction. It owns no Kafka and no driver of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from consumers.lanes.commands import (
    Command,
    CommandResult,
    Decision,
    LaneConfig,
    LogIntent,
    Outcome,
    StateView,
)
from consumers.lanes.rules import complete, complete_effect, decide
from consumers.runtime.executor import CommandRunner
from consumers.runtime.metrics import OUTCOME_WORDS, lane_of_command
from events.codec import DecidedEvent, state_key, type_name
from events.sandbox_lanes.v1 import state_pb2

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

    def decide(self, event: DecidedEvent, stored: StateView) -> Decision:
        """The decision alone (its commands become effects); its own logs are emitted."""
        decision = decide(event, stored, self.config)
        if decision.logs and decision.reject is None and not decision.duplicate:
            context = {"driver": self.config.driver_name, "eventId": event.meta.event_id}
            emit_logs(self.logger, decision.logs, context)
        return decision

    def complete(
        self,
        state: state_pb2.ExecutionState,
        effect_id: str,
        command: Command,
        result: CommandResult,
    ) -> Outcome:
        """Fold one driver call's result back; ``Outcome(None, ...)`` when it was not pending."""
        outcome = complete_effect(state, effect_id, result, self.config)
        if outcome.state is None:
            return outcome
        logger = self.logger
        causation_id = outcome.outputs[0].meta.causation_id if outcome.outputs else ""
        if outcome.logs:
            emit_logs(logger, outcome.logs, {"driver": self.config.driver_name, "eventId": causation_id})
        if outcome.outputs and logger.isEnabledFor(logging.INFO):
            kind = type_name(outcome.outputs[0]).rsplit(".", 1)[-1]
            logger.info(
                "sandbox decision",
                extra={
                    "executionId": state.execution_id,
                    "lane": lane_of_command(command),
                    "driver": self.config.driver_name,
                    "outcome": OUTCOME_WORDS.get(kind, kind),
                    "eventId": causation_id,
                },
            )
        return outcome

    async def process(self, event: DecidedEvent, stored: StateView) -> Processed:
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
        for command, output in zip(decision.commands, outcome.outputs[len(decision.outputs) :], strict=False):
            kind = type_name(output).rsplit(".", 1)[-1]
            self.logger.info(
                "sandbox decision",
                extra={
                    "executionId": state_key(event),
                    "lane": lane_of_command(command),
                    "driver": self.config.driver_name,
                    "outcome": OUTCOME_WORDS.get(kind, kind),
                    "eventId": event.meta.event_id,
                },
            )
        return Processed(decision, outcome)
