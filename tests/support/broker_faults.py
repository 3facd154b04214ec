"""Support for the broker-fault run (tests/chaos/test_broker_faults.py): two pods under ``exactly_once``
on the harness's three-node cluster, a steady input stream, nodes killed and restarted one at a time.

The parts, each usable alone:

* :class:`OrderedFeed`: produces a chaos workload (tests/support/chaos_workload.py) at its pace, each
  execution's records strictly in plan order (a record is sent only once the one before it of the same
  key is acknowledged, however long a fault holds the first: the oracle's order is the order produced),
  and records each input's acknowledgement time.
* :class:`OutcomeWatch`: reads the outcome topic ``read_committed`` as the run goes and records when
  each outcome became readable.
* :class:`HealthWatch`: polls a pod's ``/healthz`` the way the kubelet does (3 s timeout) and keeps the
  longest loop stall the pod reported or that left it unanswered.
* :func:`longest_pipeline_stall`: the longest time with inputs waiting for their outcome and no
  outcome written.
* :func:`exactly_once_figures`: duplicates and losses, counted from the topics against the oracle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumers.ops.settings import load_settings
from consumers.tools.topic_io import topic_for
from events.codec import OUTCOME_TYPES, decode, encode
from events.sandbox_lanes.v1 import inputs_pb2
from tests.support.chaos_verify import PROVISION_TYPES, TEARDOWN_TYPES, RawRecord, _partitions
from tests.support.chaos_workload import Expected, Planned, Workload
from tests.support.pod_harness import PodProcess

# --- the feed -------------------------------------------------------------------------------------


def _key(event: object) -> str:
    execution_id = getattr(event, "execution_id", "")
    return str(execution_id or getattr(event, "session_id", ""))


@dataclass
class OrderedFeed:
    """Produce ``plan`` (sorted by ``at``) in real time until :meth:`stop` is called; every record of
    one key after the previous one of that key was acknowledged (``acks=all``)."""

    bootstrap: str
    env: dict[str, str]
    plan: list[Planned]
    attempts: int = 240
    sent: list[Planned] = field(default_factory=list)
    """The records handed to the producer, in plan order: the workload the oracle judges."""
    acked_at: dict[str, float] = field(default_factory=dict)
    """input event id → monotonic time its record was acknowledged (the first time, for a duplicate)."""
    resends: int = 0
    started_at: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _chains: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        topics = load_settings(self.env).topics
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            enable_idempotence=True,
            linger_ms=2,
            request_timeout_ms=15000,
        )
        await producer.start()
        try:
            self.started_at = time.monotonic()
            i = 0
            while i < len(self.plan) and not self._stop.is_set():
                now = time.monotonic() - self.started_at
                while i < len(self.plan) and self.plan[i].at <= now:
                    item = self.plan[i]
                    key = _key(item.event)
                    topic = topic_for(item.event, topics)
                    previous = self._chains.get(key)
                    self._chains[key] = asyncio.create_task(self._send(producer, topic, item, previous))
                    self.sent.append(item)
                    i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.02)
            chains = list(self._chains.values())
            await asyncio.gather(*chains)  # a record never produced raises here: the run is void
        finally:
            for task in self._chains.values():
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 30)

    async def _send(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        item: Planned,
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None:
            await previous
        record = encode(item.event, source="broker-faults-feeder")
        for _ in range(self.attempts):
            try:
                await producer.send_and_wait(topic, record.value, key=record.key, headers=record.headers)
            except Exception:
                self.resends += 1
                await asyncio.sleep(0.5)
                continue
            self.acked_at.setdefault(item.event.meta.event_id, time.monotonic())
            return
        raise RuntimeError(f"feeder: {topic} refused a record {self.attempts} times")

    def workload(self, base: Workload) -> Workload:
        """``base`` cut to what was sent (a prefix in time of its plan: every kept record's history
        before it is kept too)."""
        counts = dict(base.counts)
        counts["events"] = len(self.sent)
        return Workload(base.seed, self.executions, list(self.sent), [], base.sessions, counts)

    @property
    def executions(self) -> int:
        return len(
            {p.event.execution_id for p in self.sent if isinstance(p.event, inputs_pb2.ExecutionCreated)}
        )


# --- what became readable, and when ---------------------------------------------------------------


@dataclass
class OutcomeWatch:
    """Every outcome readable (``read_committed``) on the outcome topic, with the time it was first seen."""

    bootstrap: str
    topic: str
    seen: list[tuple[float, str]] = field(default_factory=list)
    """(monotonic time first read, causation id) per outcome record."""
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        await consumer.start()
        try:
            partitions = await _partitions(consumer, self.topic)
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while not self._stop.is_set():
                batch = await consumer.getmany(timeout_ms=200, max_records=5000)
                now = time.monotonic()
                for records in batch.values():
                    for rec in records:
                        raw_headers = list(rec.headers or ())
                        try:
                            message = decode(rec.key, rec.value, raw_headers, allowed=OUTCOME_TYPES)
                        except Exception:
                            continue  # the verdict reads the topic again and reports what does not decode
                        self.seen.append((now, message.meta.causation_id))
        finally:
            await consumer.stop()


# --- liveness as the kubelet sees it --------------------------------------------------------------


@dataclass
class HealthWatch:
    """Polls ``/healthz`` of one pod every ``period_s`` with the kubelet's ``timeout_s`` from the pod's
    first 200 until :meth:`stop`. A stall is either what the pod's liveness judges (``seconds_stalled``:
    the loop standing still beyond the deadlines of the broker waits it declared, and "loop stalled" once
    past its window) or a stretch without an answer (its event loop not serving). The raw time since the
    loop turned (``seconds_since_loop``, declared waits included) is kept beside it."""

    name: str
    port: int
    period_s: float = 0.5
    timeout_s: float = 3.0
    on_stall: Callable[[str, str], None] | None = None
    """Called once per pod, the first time it reports "loop stalled" (to take a thread dump)."""
    answered: bool = False
    polls: int = 0
    longest_reported_s: float = 0.0
    """The largest ``seconds_since_loop`` the pod reported (its declared broker waits included)."""
    longest_stalled_s: float = 0.0
    """The largest ``seconds_stalled`` the pod reported: what its liveness window judges."""
    longest_unanswered_s: float = 0.0
    stalled_answers: list[str] = field(default_factory=list)
    """Each "loop stalled" detail the pod answered (503)."""
    other_failures: Counter[str] = field(default_factory=Counter)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self._stop.set()

    @property
    def longest_stall_s(self) -> float:
        return max(self.longest_stalled_s, self.longest_unanswered_s)

    async def run(self) -> None:
        url = f"http://127.0.0.1:{self.port}/healthz"
        unanswered_since: float | None = None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                began = time.monotonic()
                body: dict[str, object] | None = None
                status = 0
                try:
                    async with session.get(url) as resp:
                        status = resp.status
                        body = json.loads(await resp.text())
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    body = None
                if self._stop.is_set():
                    break
                if body is not None:
                    self.answered = True
                    self.polls += 1
                    if unanswered_since is not None:
                        self.longest_unanswered_s = max(self.longest_unanswered_s, began - unanswered_since)
                        unanswered_since = None
                    since = float(body.get("seconds_since_loop", 0.0))  # type: ignore[arg-type]
                    self.longest_reported_s = max(self.longest_reported_s, since)
                    stalled = float(body.get("seconds_stalled", since))  # type: ignore[arg-type]
                    self.longest_stalled_s = max(self.longest_stalled_s, stalled)
                    detail = str(body.get("detail", ""))
                    if status != 200 and detail.startswith("loop stalled"):
                        if not self.stalled_answers and self.on_stall is not None:
                            self.on_stall(self.name, detail)
                        self.stalled_answers.append(detail)
                    elif status != 200:
                        self.other_failures[detail] += 1
                elif self.answered:
                    self.polls += 1
                    if unanswered_since is None:
                        unanswered_since = began
                    self.longest_unanswered_s = max(
                        self.longest_unanswered_s, time.monotonic() - unanswered_since
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._stop.wait(), max(0.0, self.period_s - (time.monotonic() - began))
                    )


def thread_dump(pid: int, out: Path) -> str:
    """``py-spy dump`` of a process into ``out`` (diagnosis only; never part of a verdict). Returns
    where it went, or why there is none."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "no py-spy installed (`.venv/bin/pip install py-spy` for thread dumps)"
    text = ""
    for extra in (["--native"], []):  # native frames name the librdkafka call a thread waits in
        try:
            result = subprocess.run(
                [spy, "dump", *extra, "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            text += f"py-spy dump {' '.join(extra)} failed: {exc}\n"
            continue
        text += result.stdout + result.stderr
        if result.returncode == 0:
            break
    out.write_text(text)
    return str(out)


# --- figures --------------------------------------------------------------------------------------


def longest_pipeline_stall(
    acked_at: dict[str, float], outcome_times: Iterable[tuple[float, str]], awaited: Iterable[str], end: float
) -> tuple[float, float]:
    """The longest time during which at least one input of ``awaited`` (ids that must yield an outcome)
    had been acknowledged without its outcome being readable, and no outcome at all became readable.

    Returns (seconds, when it began, monotonic). An input whose outcome never came counts as pending
    until ``end``."""
    first_out: dict[str, float] = {}
    times: list[float] = []
    for at, cause in outcome_times:
        times.append(at)
        first_out.setdefault(cause, at)
    times.sort()
    pending = sorted((acked_at[i], first_out.get(i, end)) for i in set(awaited) if i in acked_at)
    active: list[tuple[float, float]] = []  # (acknowledged, outcome readable) of inputs acknowledged so far
    best, best_from, last_out, j = 0.0, 0.0, float("-inf"), 0
    for t in [*times, end]:
        while j < len(pending) and pending[j][0] < t:
            active.append(pending[j])
            j += 1
        # Waiting just before t: acknowledged before t, its outcome readable at t or later.
        active = [(acked, done) for acked, done in active if done >= t]
        if active:
            began = max(last_out, min(acked for acked, _ in active))
            if t - began > best:
                best, best_from = t - began, began
        last_out = t
    return best, best_from


@dataclass
class ExactlyOnce:
    duplicates: int
    losses: int
    details: list[str]


def exactly_once_figures(
    outcomes: list[RawRecord], dead_letters: list[RawRecord], expected: Expected
) -> ExactlyOnce:
    """Duplicates: outcome records beyond one per input that must have one (same id copies, a second
    outcome for one input, an outcome for an input that must have none). Losses: inputs that must have
    an outcome and have none, and valid inputs dead-lettered."""
    per_cause: dict[tuple[str, str], int] = defaultdict(int)
    details: list[str] = []
    unexpected = 0
    for rec in outcomes:
        raw_headers = [(k, v.encode()) for k, v in rec.headers.items()]
        message = decode(rec.key, rec.value, raw_headers, allowed=OUTCOME_TYPES)
        cause = message.meta.causation_id
        if isinstance(message, PROVISION_TYPES):
            per_cause[(cause, "provision")] += 1
            if cause not in expected.provision:
                unexpected += 1
                details.append(f"unexpected {type(message).__name__} (cause {cause})")
        elif isinstance(message, TEARDOWN_TYPES):
            per_cause[(cause, "teardown")] += 1
            if cause not in expected.teardown and cause not in expected.teardown_optional:
                unexpected += 1
                details.append(f"unexpected {type(message).__name__} (cause {cause})")
    duplicates = unexpected + sum(n - 1 for n in per_cause.values() if n > 1)
    details += [f"{n} {what} outcomes for input {cause}" for (cause, what), n in per_cause.items() if n > 1]
    lost = [c for c in expected.provision if (c, "provision") not in per_cause]
    lost += [c for c in expected.teardown if (c, "teardown") not in per_cause]
    details += [f"no outcome for input {c}" for c in lost[:10]]
    wrongly_dead = [
        f"valid input {rec.headers.get('ce_id')} dead-lettered: {rec.headers.get('dlq_reason')}"
        for rec in dead_letters
        if rec.headers.get("ce_id", "") not in expected.dead_letters
    ]
    details += wrongly_dead[:10]
    return ExactlyOnce(duplicates, len(lost) + len(wrongly_dead), details)


# --- the pods -------------------------------------------------------------------------------------


@dataclass
class Pods:
    """``sandbox-lanes run`` processes of one group, each with its own ``/healthz`` port and watch. A
    pod that exits by itself is recorded (a violation) and started again, as its Deployment would."""

    env: dict[str, str]
    logs: Path
    ports: dict[str, int]
    health: dict[str, list[HealthWatch]] = field(default_factory=lambda: defaultdict(list))
    unplanned: list[str] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)
    procs: dict[str, PodProcess] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _starts: Counter[str] = field(default_factory=Counter)

    def start(self, name: str) -> None:
        self._starts[name] += 1
        env = {**self.env, "SANDBOX_LANES_POD_ID": name, "SANDBOX_LANES_HTTP_PORT": str(self.ports[name])}
        pod = PodProcess(env, self.logs / f"{name}-{self._starts[name]}.log")
        pod.start()
        self.procs[name] = pod
        watch = HealthWatch(name, self.ports[name], on_stall=self._on_stall)
        self.health[name].append(watch)
        self._tasks.append(asyncio.create_task(watch.run()))

    def _on_stall(self, name: str, detail: str) -> None:
        proc = self.procs[name].proc
        if proc is None:
            return
        out = self.logs / f"{name}-stalled-{len(self.dumps) + 1}.py-spy.txt"

        async def dump() -> None:
            where = await asyncio.to_thread(thread_dump, proc.pid, out)
            self.dumps.append(f"{name} ({detail}): {where}")

        self._tasks.append(asyncio.create_task(dump()))

    def check(self) -> None:
        for name, pod in list(self.procs.items()):
            if pod.proc is not None and pod.proc.poll() is not None:
                tail = pod.log()[-1200:].replace("\n", " | ")
                self.unplanned.append(f"{name} exited by itself with {pod.proc.returncode}: {tail}")
                for watch in self.health[name]:
                    watch.stop()
                self.start(name)

    async def until_ready(self, names: list[str], timeout_s: float) -> None:
        """Every named pod's /readyz answers 200 with partitions assigned (an exit on the way is
        recorded and the pod started again, as :meth:`check` does)."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            while True:
                self.check()
                assigned: dict[str, bool] = {}
                for name in names:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                        async with session.get(f"http://127.0.0.1:{self.ports[name]}/readyz") as resp:
                            body = await resp.json()
                            assigned[name] = resp.status == 200 and body.get("assigned_partitions", 0) > 0
                if all(assigned.get(n) for n in names):
                    return
                if time.monotonic() > deadline:
                    tails = {n: p.log()[-1500:] for n, p in self.procs.items()}
                    raise TimeoutError(
                        f"pods not ready with partitions in {timeout_s:g}s: {assigned}; "
                        f"exits {self.unplanned[:3]}; log tails {tails}"
                    )
                await asyncio.sleep(0.3)

    def longest_stall(self, name: str) -> float:
        return max((w.longest_stall_s for w in self.health[name]), default=0.0)

    def longest_since_turned(self, name: str) -> float:
        """The longest raw time since the loop turned the pod reported, its declared waits included."""
        return max((w.longest_reported_s for w in self.health[name]), default=0.0)

    def stalled_answers(self, name: str) -> list[str]:
        return [d for w in self.health[name] for d in w.stalled_answers]

    async def terminate(self, bound_s: float) -> dict[str, tuple[int | None, float]]:
        """SIGTERM every pod at once and wait on each process up to ``bound_s``; one still running is
        dumped (py-spy) and killed. Returns name → (exit code or None when killed, seconds)."""
        self.check()
        for watches in self.health.values():
            for watch in watches:
                watch.stop()
        began = time.monotonic()
        for pod in self.procs.values():
            assert pod.proc is not None
            pod.proc.send_signal(signal.SIGTERM)

        async def wait(name: str, pod: PodProcess) -> tuple[int | None, float]:
            assert pod.proc is not None
            try:
                code = await asyncio.to_thread(pod.proc.wait, max(0.1, bound_s - (time.monotonic() - began)))
                return code, time.monotonic() - began
            except subprocess.TimeoutExpired:
                out = self.logs / f"{name}-sigterm.py-spy.txt"
                where = await asyncio.to_thread(thread_dump, pod.proc.pid, out)
                self.dumps.append(f"{name} (still running {bound_s:g}s after SIGTERM): {where}")
                pod.proc.kill()
                await asyncio.to_thread(pod.proc.wait, 10)
                return None, time.monotonic() - began

        results = await asyncio.gather(*(wait(n, p) for n, p in self.procs.items()))
        for task in self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        return dict(zip(self.procs, results, strict=True))
