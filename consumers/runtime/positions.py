"""Where the pod stands on each owned input partition, and the seeks that keep it there.

The position is kept locally, as each commit (or take-over) left it: a rewind needs no broker round
trip, and it cannot read an unstable committed offset just after a transaction. Records that were
not decided (a turn that failed, a partition resting or being restored) go back to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

_T = TypeVar("_T")
Records = list[ConsumerRecord[bytes, bytes]]


class Positions:
    def __init__(self, bounded: Callable[[Awaitable[None]], Awaitable[None]]) -> None:
        self.consumer: AIOKafkaConsumer | None = None
        self._bounded = bounded
        #: The next offset to read per owned input partition, as its last commit (or take-over) left it.
        self.standing: dict[TopicPartition, int] = {}
        #: Where the take-over sought each partition: records fetched before that seek differ.
        self.sought: dict[TopicPartition, int] = {}

    def taken_over(self, tp: TopicPartition, offset: int) -> None:
        assert self.consumer is not None
        self.consumer.seek(tp, offset)
        self.sought[tp] = offset
        self.standing[tp] = offset

    def forget(self, partitions: set[int]) -> None:
        self.sought = {tp: o for tp, o in self.sought.items() if tp.partition not in partitions}
        self.standing = {tp: o for tp, o in self.standing.items() if tp.partition not in partitions}

    async def rewind(self, tp: TopicPartition) -> None:
        """Back to where the pod stands on ``tp`` (every turn leaves it at its last commit)."""
        assert self.consumer is not None
        standing = self.standing.get(tp)
        if standing is not None:
            self.consumer.seek(tp, standing)
            return
        # Nothing committed yet when it was taken over (auto_offset_reset=earliest): the beginning.
        await self._bounded(self.consumer.seek_to_beginning(tp))

    def seek_back(self, fetched: Mapping[TopicPartition, Records], owned: set[int]) -> None:
        """Records that were not decided are read again (from where the pod stands)."""
        assert self.consumer is not None
        for tp, recs in fetched.items():
            if not recs or tp.partition not in owned:
                continue  # not owned: its take-over seeks it
            with contextlib.suppress(Exception):  # revoked meanwhile: its next owner reads it
                self.consumer.seek(tp, self.standing.get(tp, recs[0].offset))

    def seek_to_first(self, batch: Mapping[TopicPartition, Records]) -> None:
        """A batch that was not committed: each partition back to its first record."""
        assert self.consumer is not None
        for tp, records in batch.items():
            with contextlib.suppress(Exception):
                self.consumer.seek(tp, records[0].offset)

    def stand_at(self, tp: TopicPartition, offset: int, *, seek: bool = False) -> None:
        """A commit moved the pod's position on ``tp``."""
        self.standing[tp] = offset
        if seek and self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.seek(tp, offset)

    async def drained_before_seek(self, tp: TopicPartition, recs: Records) -> bool:
        """Were these records drained before the take-over sought the partition?

        Such records start below the committed offset the take-over read (the previous owner
        committed them meanwhile), or the seek has since moved the position back over them.
        The first batch that passes ends the check for the partition.
        """
        assert self.consumer is not None
        if tp not in self.sought:
            return False
        sought = self.sought[tp]
        position = await self.consumer.position(tp)  # known after a seek: returns at once
        if recs[0].offset < sought or position <= recs[-1].offset:
            return True
        del self.sought[tp]
        return False
