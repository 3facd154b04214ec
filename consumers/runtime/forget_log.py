"""What the pod says when partitions leave it (:meth:`~consumers.runtime.ownership.Ownership.forget`):
one message per way they go, at the level its meaning calls for."""

from __future__ import annotations

import logging
from typing import Literal

logger = logging.getLogger("sandbox_lanes.pod")

#: Why the pod forgets partitions (see :meth:`Ownership.forget`).
Forgotten = Literal["released", "take-over failed", "fenced", "abandoned"]
_FORGET_MESSAGES: dict[Forgotten, str] = {
    "released": "partitions released: their driver results are void here, the next owner re-runs them",
    "take-over failed": "taking partitions over failed; retrying the take-over",
    "fenced": (
        "fenced: the partition's transactional id has a newer epoch (another writer took it over, or the"
        " broker aborted a transaction past its timeout); standing down and rejoining the group"
    ),
    "abandoned": (
        "the partition's producer is abandoned (a broker wait outlived its deadline, or an abort failed);"
        " taking the partition over anew with a new producer"
    ),
}
#: The level each is logged at: a fence is an event of its own (a zombie stood down); the world's
#: failures are an episode's, which logs its one ERROR itself.
_FORGET_LEVELS: dict[Forgotten, int] = {
    "released": logging.INFO,
    "take-over failed": logging.DEBUG,
    "fenced": logging.ERROR,
    "abandoned": logging.WARNING,
}


def log_forgotten(why: Forgotten, partitions: set[int], outstanding: int, error: str | None) -> None:
    logger.log(
        _FORGET_LEVELS[why],
        _FORGET_MESSAGES[why],
        extra={
            "partitions": ",".join(map(str, sorted(partitions))),
            "outstanding": outstanding,
            **({"error": error} if error else {}),
        },
    )


__all__ = ["Forgotten", "log_forgotten"]
