"""The console script: every subcommand answers --help, and unknown input fails clearly."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from consumers.tools import cli
from consumers.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = [
    "run",
    "demo",
    "produce",
    "tail",
    "replay",
    "explain",
    "redrive",
    "reap",
    "topics",
    "bench",
    "config",
    "config show",
    "config check",
]


def sandbox_lanes(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "sandbox-lanes"
    return subprocess.run([str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_subcommand_is_registered() -> None:
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert choices is not None
    assert {c.split()[0] for c in SUBCOMMANDS} == set(choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str) -> None:
    done = sandbox_lanes(*command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sandbox-lanes " + command)


def test_top_level_help_lists_the_subcommands() -> None:
    done = sandbox_lanes("--help")
    assert done.returncode == 0
    for command in {c.split()[0] for c in SUBCOMMANDS}:
        assert command in done.stdout


def test_an_unknown_subcommand_fails_with_usage() -> None:
    done = sandbox_lanes("frobnicate")
    assert done.returncode == 2 and "invalid choice: 'frobnicate'" in done.stderr


def test_an_absent_dev_tool_is_not_listed_and_says_where_it_comes_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in the product install (the bench is in the dev tools' distribution): its module cannot be found.
    absent = "sandbox_lanes_bench_not_installed"
    commands = tuple((n, absent if n == "bench" else m, h) for n, m, h in cli.MODULE_COMMANDS)
    monkeypatch.setattr(cli, "MODULE_COMMANDS", commands)
    monkeypatch.setattr(cli, "OPTIONAL_COMMANDS", {absent: cli.OPTIONAL_COMMANDS["sandbox_lanes_bench"]})
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" not in capsys.readouterr().out
    for argv in (["bench"], ["bench", "--only", "rules", "--repeats", "1"], ["bench", "--help"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("sandbox-lanes bench: the bench is a dev tool") and "devtools[bench]" in err, (
            argv
        )


def test_produce_refuses_a_file_with_an_unknown_event_type(tmp_path: Path) -> None:
    events = tmp_path / "events.yaml"
    events.write_text("- type: Nonsense\n  execution_id: x\n")
    done = sandbox_lanes("produce", str(events), "--bootstrap", "127.0.0.1:9")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"sandbox-lanes produce: {events}: event #0: unknown event type 'Nonsense' "
        "(known: ExecutionCreated, PhaseChanged, SessionDeleted)"
    )
    missing = sandbox_lanes("produce", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "No such file or directory" in missing.stderr


def test_version() -> None:
    done = sandbox_lanes("--version")
    assert done.returncode == 0 and done.stdout.strip() == "sandbox-lanes 0.1.0", done.stdout + done.stderr


def _isolated(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "STIGMER_", "KAFKA_"))}
    return {**base, **env}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["replay", "--from-time", "yesterday"], "argument --from-time: 'yesterday' is not a time"),
        (["tail", "--max", "lots"], "argument --max: invalid int value: 'lots'"),
        (["topics", "--format", "helm"], "argument --format: invalid choice: 'helm'"),
        (["tail"], 'cannot connect to Kafka: Unable connect to "127.0.0.1:1"'),
        (["replay", "--from-beginning"], 'cannot connect to Kafka: Unable connect to "127.0.0.1:1"'),
        (["topics", "--apply"], 'cannot connect to Kafka: Unable connect to "127.0.0.1:1"'),
        (["run"], "cannot connect to Kafka at 127.0.0.1:1 over PLAINTEXT"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_argument_or_an_unreachable_broker_is_one_line_and_exit_2(argv: list[str], needle: str) -> None:
    script = Path(sys.executable).parent / "sandbox-lanes"
    done = subprocess.run(
        [str(script), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=_isolated(KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:1", SANDBOX_LANES_HTTP_PORT="0"),
    )
    assert done.returncode == 2, done.stderr
    *logs, line = done.stderr.splitlines()
    if argv[0] == "run":  # the pod's own log (JSON lines) says what the client logged on the way
        assert all(log.startswith("{") for log in logs), done.stderr
    else:
        assert logs == [], done.stderr
    assert line.startswith(f"sandbox-lanes {argv[0]}: ") and needle in line, line


def test_topics_prints_the_plan_as_kafka_topics_commands_and_strimzi_resources() -> None:
    env = _isolated(
        SANDBOX_LANES_REPLICATION="3", SANDBOX_LANES_PARTITIONS="6", SANDBOX_LANES_TOPIC_DLQ="Lanes_DLQ"
    )
    script = str(Path(sys.executable).parent / "sandbox-lanes")
    commands = subprocess.run(
        [script, "topics", "--bootstrap", "kafka:9092"], capture_output=True, text=True, env=env, check=True
    ).stdout
    lines = [shlex.split(line) for line in commands.splitlines() if not line.startswith("#")]
    assert len(lines) == 7
    by_topic = {args[args.index("--topic") + 1]: args for args in lines}
    config = by_topic["sandbox-lanes-state-config"]  # the lane configuration records: one partition
    assert config[config.index("--partitions") + 1] == "1" and "cleanup.policy=compact" in config
    state = by_topic["sandbox-lanes-state"]
    assert state[:3] == ["kafka-topics.sh", "--bootstrap-server", "kafka:9092"]
    assert (
        state[state.index("--partitions") + 1] == "6"
        and state[state.index("--replication-factor") + 1] == "3"
    )
    configs = {state[i + 1] for i, a in enumerate(state) if a == "--config"}
    assert {"cleanup.policy=compact", "min.insync.replicas=2", "delete.retention.ms=86400000"} <= configs
    dlq = by_topic["Lanes_DLQ"]
    assert "retention.ms=2419200000" in dlq
    assert by_topic["execution-created"][-2:] == ["--config", "min.insync.replicas=2"]  # RF 3: 2 in sync

    strimzi = subprocess.run(
        [script, "topics", "--format", "strimzi", "--strimzi-cluster", "prod"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    docs = {d["spec"].get("topicName", d["metadata"]["name"]): d for d in yaml.safe_load_all(strimzi)}
    assert set(docs) == {
        "execution-created",
        "phase-changed",
        "session-deleted",
        "sandbox-lanes-state",
        "sandbox-lanes-state-config",
        "sandbox-outcomes",
        "Lanes_DLQ",
    }
    state_doc = docs["sandbox-lanes-state"]
    assert state_doc["apiVersion"] == "kafka.strimzi.io/v1beta2" and state_doc["kind"] == "KafkaTopic"
    assert state_doc["metadata"]["labels"] == {"strimzi.io/cluster": "prod"}
    assert (state_doc["spec"]["partitions"], state_doc["spec"]["replicas"]) == (6, 3)
    assert state_doc["spec"]["config"]["cleanup.policy"] == "compact"
    assert docs["Lanes_DLQ"]["metadata"]["name"] == "lanes-dlq"  # a valid resource name, topicName kept

    broker_default = subprocess.run(
        [script, "topics", "--format", "strimzi"], capture_output=True, text=True, env=_isolated(), check=True
    ).stdout
    for doc in yaml.safe_load_all(broker_default):
        assert "replicas" not in doc["spec"]  # -1: the broker's default.replication.factor
        assert "min.insync.replicas" not in doc["spec"].get("config", {})  # and its min.insync.replicas
