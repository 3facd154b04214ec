"""Configuration: every knob validated at start-up, the optional config file, ``config show``, logs.

Bad values are checked three ways: ``load_settings`` raises a :class:`ConfigError` naming the
variable and what is allowed; ``sandbox-lanes config show`` exits 2 with that message; and
``sandbox-lanes run`` (a real child process) fails fast with it before touching Kafka.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from consumers.ops.logs import REDACTED, setup_logging
from consumers.ops.settings import SETTINGS, ConfigError, load_settings
from consumers.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOOD_KEY = base64.b64encode(b"k" * 32).decode()

#: (variable, bad value, what the message must say besides the variable's name)
INVALID: list[tuple[str, str, str]] = [
    ("KAFKA_BOOTSTRAP_SERVERS", "localhost", "allowed: comma-separated host:port"),
    ("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:99999", "port 1-65535"),
    ("SANDBOX_LANES_PROCESSING_GUARANTEE", "twice", "allowed: exactly_once, at_least_once"),
    ("SANDBOX_LANES_SEQUENTIAL_PRODUCE", "maybe", "allowed: true, false"),
    ("SANDBOX_LANES_CREATE_TOPICS", "2", "allowed: true, false"),
    ("SANDBOX_LANES_PARTITIONS", "three", "is not a whole number"),
    ("SANDBOX_LANES_PARTITIONS", "0", "must be at least 1"),
    ("SANDBOX_LANES_REPLICATION", "0", "allowed: -1 (the broker's default) or a whole number"),
    ("SANDBOX_LANES_REPLICATION", "-2", "allowed: -1 (the broker's default) or a whole number"),
    ("SANDBOX_LANES_REAP_INTERVAL_S", "abc", "is not a number"),
    ("SANDBOX_LANES_REAP_GRACE_S", "-1", "must be zero or positive"),
    ("SANDBOX_LANES_SESSION_TIMEOUT_MS", "10", "must be at least 1000"),
    ("SANDBOX_LANES_SHUTDOWN_TIMEOUT_S", "soon", "is not a number"),
    ("SANDBOX_LANES_ENSURE_TIMEOUT_S", "0", "must be positive"),
    ("SANDBOX_LANES_TEARDOWN_TIMEOUT_S", "-5", "must be positive"),
    ("SANDBOX_LANES_TOPIC_STATE", "state topic", "allowed: a Kafka topic name"),
    ("SANDBOX_LANES_TOPIC_DLQ", "sandbox-outcomes", "the same topic as SANDBOX_LANES_TOPIC_OUTCOMES"),
    ("STIGMER_ACTIVITY_ROUTING", "per-session", "allowed: global, session"),
    ("STIGMER_WORKFLOW_ACTIVITY_ROUTING", "exec", "allowed: global, execution"),
    ("STIGMER_RUNNER_TOKEN_KEY", "not base64!", "allowed: base64 of a 32-byte key"),
    ("STIGMER_RUNNER_TOKEN_KEY", base64.b64encode(b"short").decode(), "decodes to 5 bytes"),
    ("STIGMER_RUNNER_TOKEN_KEY_FILE", "/nonexistent/key", "cannot be read"),
    ("STIGMER_SANDBOX_RUNNER_ENV", "NOT_SET_ANYWHERE_X", "has no value in the environment"),
    ("STIGMER_SANDBOX_RUNNER_SECRETS", "STIGMER_TASK_QUEUE", "is set by the driver itself"),
    ("SANDBOX_LANES_DRIVER_OPTIONS", "memory", "is not key=value"),
    ("SANDBOX_LANES_HTTP_PORT", "http", "allowed: a port number 0-65535"),
    ("SANDBOX_LANES_HTTP_PORT", "70000", "allowed: a port number 0-65535"),
    ("SANDBOX_LANES_STALL_SECONDS", "0", "must be positive"),
    ("SANDBOX_LANES_LOG_LEVEL", "loud", "allowed: debug, info, warning, error"),
    ("SANDBOX_LANES_LOG_FORMAT", "xml", "allowed: auto, json, human"),
    ("SANDBOX_LANES_CONFIG_FILE", "/nonexistent/sandbox-lanes.yaml", "no such file"),
]


def _id(case: tuple[str, str, str]) -> str:
    return f"{case[0]}={case[1][:12]}"


@pytest.mark.parametrize("case", INVALID, ids=[_id(c) for c in INVALID])
def test_each_invalid_value_fails_with_the_variable_and_what_is_allowed(case: tuple[str, str, str]) -> None:
    name, value, allowed = case
    with pytest.raises(ConfigError) as err:
        load_settings({name: value})
    message = str(err.value)
    assert name in message and allowed in message, message


@pytest.mark.parametrize("case", INVALID[::4], ids=[_id(c) for c in INVALID[::4]])
def test_config_show_exits_2_with_the_message(
    case: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name, value, allowed = case
    monkeypatch.setenv(name, value)
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sandbox-lanes: configuration error: ") and name in err and allowed in err, err


def test_run_fails_fast_on_a_bad_value_before_touching_kafka(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",  # nothing listens: a start would hang, not exit 2
        "SANDBOX_LANES_PROCESSING_GUARANTEE": "exactly-once",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", "run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "SANDBOX_LANES_PROCESSING_GUARANTEE='exactly-once' is invalid; allowed: exactly_once, at_least_once"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_the_defaults_are_valid_and_every_knob_is_shown() -> None:
    settings = load_settings({})
    shown = settings.effective()
    assert list(shown) == [s.env for s in SETTINGS]
    assert (settings.http_host, settings.http_port, settings.stall_seconds) == ("0.0.0.0", 8080, 30.0)
    assert (settings.log_level, settings.log_format, settings.warnings) == ("info", "auto", ())
    assert shown["SANDBOX_LANES_POD_ID"]  # the hostname


def test_config_show_masks_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STIGMER_RUNNER_TOKEN_KEY", GOOD_KEY)
    monkeypatch.setenv("SANDBOX_LANES_DRIVER_OPTIONS", "api_token=hunter2hunter2,memory=2g")
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)
    assert shown["STIGMER_RUNNER_TOKEN_KEY"] == "****"
    assert shown["SANDBOX_LANES_DRIVER_OPTIONS"] == "api_token=****,memory=2g"
    assert GOOD_KEY not in out and "hunter2" not in out


def test_a_target_that_is_neither_local_nor_cloud_is_kept_but_warned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = load_settings({"STIGMER_DEFAULT_EXECUTION_TARGET": "Cloud"})
    assert settings.agent.default_execution_target == "Cloud"  # upstream: not exactly "cloud" = local
    (warning,) = settings.warnings
    assert "STIGMER_DEFAULT_EXECUTION_TARGET='Cloud'" in warning and "'cloud'" in warning
    monkeypatch.setenv("STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET", "remote")
    assert main(["config", "show"]) == 0
    assert "warning: STIGMER_WORKFLOW_DEFAULT_EXECUTION_TARGET='remote'" in capsys.readouterr().err


# --- the config file ---------------------------------------------------------------------------


def test_a_yaml_config_file_under_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "sandbox-lanes.yaml"
    path.write_text(
        "KAFKA_BOOTSTRAP_SERVERS: kafka-1:9092,kafka-2:9092\n"
        "SANDBOX_LANES_PARTITIONS: 6\n"
        "SANDBOX_LANES_CREATE_TOPICS: false\n"
        "SANDBOX_LANES_GROUP_ID: from-file\n"
        "SANDBOX_LANES_TOPIC_OUTCOMES: from-file-outcomes\n"
        "STIGMER_SANDBOX_RUNNER_ENV: [RUNNER_REGION]\n"
        "RUNNER_REGION: eu-west-1\n"
        "SANDBOX_LANES_DRIVER_OPTIONS: {memory: 4g, cpus: 2}\n"
    )
    settings = load_settings(
        {
            "SANDBOX_LANES_CONFIG_FILE": str(path),
            "SANDBOX_LANES_GROUP_ID": "from-env",  # the environment wins
            "SANDBOX_LANES_TOPIC_OUTCOMES": "",  # empty = unset: the file's value applies
        }
    )
    assert settings.bootstrap == "kafka-1:9092,kafka-2:9092"
    assert (settings.partitions, settings.create_topics) == (6, False)
    assert settings.group_id == "from-env"
    assert settings.topics.outcomes == "from-file-outcomes"
    assert settings.driver.runner_env == {"RUNNER_REGION": "eu-west-1"}
    assert settings.driver.options == {"memory": "4g", "cpus": "2"}
    assert settings.config_file == str(path)
    assert settings.effective()["SANDBOX_LANES_CONFIG_FILE"] == str(path)


def test_a_dotenv_config_file(tmp_path: Path) -> None:
    path = tmp_path / "pod.env"
    path.write_text(
        "# comment\n"
        "export SANDBOX_LANES_PROCESSING_GUARANTEE=at_least_once\n"
        'SANDBOX_LANES_POD_ID="pod from file"\n'
        "SANDBOX_LANES_HTTP_PORT=9100  # metrics\n"
        f"STIGMER_RUNNER_TOKEN_KEY='{GOOD_KEY}'\n"
    )
    settings = load_settings({"SANDBOX_LANES_CONFIG_FILE": str(path)})
    assert settings.guarantee == "at_least_once"
    assert settings.pod_id == "pod from file"
    assert settings.http_port == 9100
    assert settings.effective()["STIGMER_RUNNER_TOKEN_KEY"] == "****"
    assert settings.secret_values == [GOOD_KEY]


def test_a_bad_value_in_the_file_is_named_like_one_in_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("SANDBOX_LANES_LOG_FORMAT: xml\n")
    with pytest.raises(
        ConfigError, match=r"SANDBOX_LANES_LOG_FORMAT='xml' is invalid; allowed: auto, json, human"
    ):
        load_settings({"SANDBOX_LANES_CONFIG_FILE": str(path)})


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "typo.yaml",
            "SANDBOX_LANES_PARTITONS: 3\n",
            "unknown setting 'SANDBOX_LANES_PARTITONS'; did you mean 'SANDBOX_LANES_PARTITIONS'?",
        ),
        ("list.yaml", "- a\n- b\n", "expected a mapping of VARIABLE: value"),
        ("broken.yaml", "KAFKA_BOOTSTRAP_SERVERS: [\n", "not valid YAML"),
        ("nested.yaml", "SANDBOX_LANES_GROUP_ID: {a: 1}\n", "SANDBOX_LANES_GROUP_ID must be a string"),
        ("bad.env", "JUST A LINE\n", "bad.env:1: expected NAME=value"),
        ("self.env", "SANDBOX_LANES_CONFIG_FILE=other.env\n", "cannot be set from the config file itself"),
    ],
)
def test_a_malformed_config_file_fails_with_the_file_and_the_problem(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_settings({"SANDBOX_LANES_CONFIG_FILE": str(path)})
    assert message in str(err.value) and str(path) in str(err.value), str(err.value)


def test_the_global_config_flag(tmp_path: Path) -> None:
    path = tmp_path / "flag.yaml"
    path.write_text("SANDBOX_LANES_GROUP_ID: from-flag\nSANDBOX_LANES_PARTITIONS: 5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_LANES_")}
    env.update(PYTHONPATH=str(ROOT), SANDBOX_LANES_PARTITIONS="7")
    for argv in (["--config", str(path), "config", "show"], ["config", "--config", str(path), "show"]):
        proc = subprocess.run(
            [sys.executable, "-m", "consumers.tools.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr  # before the subcommand, or right after it
        shown = json.loads(proc.stdout)
        assert shown["SANDBOX_LANES_GROUP_ID"] == "from-flag"
        assert shown["SANDBOX_LANES_PARTITIONS"] == "7"  # the environment wins over the file
        assert shown["SANDBOX_LANES_CONFIG_FILE"] == str(path)


# --- logs ----------------------------------------------------------------------------------------


def test_json_logs_one_object_a_line_with_the_fields_and_secrets_redacted() -> None:
    stream = io.StringIO()
    setup_logging("info", stream=stream, secrets=[GOOD_KEY])
    log = logging.getLogger("sandbox_lanes.test")
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJlc2ln"
    log.info(
        "sandbox decision",
        extra={"executionId": "wfx_1", "lane": "workflow", "driver": "docker", "outcome": "provisioned"},
    )
    log.warning("driver said %s with key %s", jwt, GOOD_KEY)
    log.debug("not shown at info")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert {k: first[k] for k in ("msg", "level", "executionId", "lane", "driver", "outcome")} == {
        "msg": "sandbox decision",
        "level": "info",
        "executionId": "wfx_1",
        "lane": "workflow",
        "driver": "docker",
        "outcome": "provisioned",
    }
    assert second["msg"] == f"driver said {REDACTED} with key {REDACTED}"
    assert jwt not in stream.getvalue() and GOOD_KEY not in stream.getvalue()


def test_human_logs_on_a_terminal_json_otherwise() -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            setup_logging("info", stream=tty)  # auto: a terminal → human-readable
            logging.getLogger("sandbox_lanes.test").info("hello", extra={"lane": "session"})
            tty.flush()
            text = os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "INFO    hello  lane=session" in text and "{" not in text
    pipe = io.StringIO()
    setup_logging("info", stream=pipe)  # auto: not a terminal → JSON
    logging.getLogger("sandbox_lanes.test").info("hello")
    assert json.loads(pipe.getvalue())["msg"] == "hello"
    forced = io.StringIO()
    setup_logging("info", stream=forced, json_lines=False)  # SANDBOX_LANES_LOG_FORMAT=human
    logging.getLogger("sandbox_lanes.test").info("hello")
    assert "INFO    hello" in forced.getvalue()
    setup_logging("warning")


def test_an_unknown_provisioner_type_is_upstreams_exact_boot_error() -> None:
    """Spec 1.2.3: the message lists every known type, sorted, in upstream's exact form."""
    from drivers.registry import known_types

    with pytest.raises(ConfigError) as err:
        load_settings({"SANDBOX_PROVISIONER_TYPE": "daytona"})
    listed = ", ".join(f"'{n}'" for n in sorted(known_types()))
    assert str(err.value) == f"unknown sandbox provisioner type 'daytona' — known types: {listed}"
    assert {"agent-sandbox", "docker", "kubernetes", "local-process"} <= set(known_types())


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"STIGMER_SANDBOX_RUNNER_ENV": "FOO", "FOO": ""}, "'FOO' is listed but has no value"),
        (
            {"STIGMER_SANDBOX_RUNNER_SECRETS": "TEMPORAL_TLS_KEY", "TEMPORAL_TLS_KEY": "k"},
            "Temporal connection",
        ),
        (
            {"STIGMER_SANDBOX_RUNNER_ENV": "STIGMER_TEMPORAL_API_KEY", "STIGMER_TEMPORAL_API_KEY": "k"},
            "Temporal connection",
        ),
        (
            {"STIGMER_SANDBOX_RUNNER_ENV": "ANTHROPIC_API_KEY", "ANTHROPIC_API_KEY": "k"},
            "known runner secrets on the plain list: ANTHROPIC_API_KEY",
        ),
        (
            {
                "SANDBOX_PROVISIONER_TYPE": "docker",
                "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://b",
                "STIGMER_SANDBOX_RUNNER_ENV": "HOME",
                "HOME": "/home/x",
            },
            "'HOME' may not be listed for the image-starting driver 'docker'",
        ),
    ],
)
def test_runner_lists_refuse_what_upstream_refuses_at_boot(extra: dict[str, str], needle: str) -> None:
    """Spec 1.2.1: an empty listed value, a Temporal connection name, a known secret on the plain
    list, HOME under an image-starting driver: each is boot-fatal."""
    with pytest.raises(ConfigError) as err:
        load_settings(extra)
    assert needle in str(err.value), str(err.value)


def test_home_may_be_listed_for_the_local_process_driver() -> None:
    settings = load_settings({"STIGMER_SANDBOX_RUNNER_ENV": "HOME", "HOME": "/home/x"})
    assert settings.driver.runner_env == {"HOME": "/home/x"}


def test_the_servers_temporal_connection_is_rendered_for_runners(tmp_path: Path) -> None:
    """Spec 1.2.7: STIGMER_TEMPORAL_* as the runners' temporal_connection_env, each PEM file as _DATA."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n")
    settings = load_settings(
        {
            "STIGMER_TEMPORAL_API_KEY": "api-key-1",
            "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(ca),
            "STIGMER_TEMPORAL_TLS_SERVER_NAME": "temporal.internal",
        }
    )
    assert dict(settings.driver.temporal_connection_env) == {
        "STIGMER_TEMPORAL_API_KEY": "api-key-1",
        "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_DATA": ca.read_text(),
        "STIGMER_TEMPORAL_TLS_SERVER_NAME": "temporal.internal",
    }
    assert "api-key-1" in settings.secret_values
    with pytest.raises(ConfigError, match="cannot be read"):
        load_settings({"STIGMER_TEMPORAL_TLS_CLIENT_KEY_PATH": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="both set"):
        load_settings(
            {
                "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(ca),
                "STIGMER_TEMPORAL_TLS_SERVER_CA_CERT_DATA": "x",
            }
        )


def test_a_credential_provider_is_chosen_by_its_installed_entry_point_name() -> None:
    assert load_settings({"SANDBOX_LANES_CREDENTIAL_PROVIDER": "test-capability"}).credential_provider == (
        "test-capability"
    )
    with pytest.raises(ConfigError) as err:
        load_settings({"SANDBOX_LANES_CREDENTIAL_PROVIDER": "vault"})
    assert "SANDBOX_LANES_CREDENTIAL_PROVIDER='vault' is invalid" in str(err.value)
    assert "known: 'test-capability'" in str(err.value)


# --- one validation path: `config check` refuses exactly what `run` refuses ------------------------

#: Configurations `run` used to end in a traceback (or a silent default) with; `config show` passed them.
REFUSED: list[tuple[str, dict[str, str], str]] = [
    (
        "docker without its backend endpoint",
        {"SANDBOX_PROVISIONER_TYPE": "docker"},
        "sandbox provisioner 'docker' requires STIGMER_SANDBOX_BACKEND_ENDPOINT",
    ),
    (
        "kubernetes off-cluster",
        {
            "SANDBOX_PROVISIONER_TYPE": "kubernetes",
            "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://stigmer:8080",
            "KUBECONFIG": "/nonexistent/kubeconfig",
        },
        "sandbox provisioner 'kubernetes': no usable Kubernetes client config",
    ),
    (
        "a bad driver option value",
        {
            "SANDBOX_PROVISIONER_TYPE": "docker",
            "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://stigmer:8080",
            "SANDBOX_LANES_DRIVER_OPTIONS": "memory=lots",
        },
        "memory",
    ),
    (
        "a misspelled driver option",
        {
            "SANDBOX_PROVISIONER_TYPE": "docker",
            "STIGMER_SANDBOX_BACKEND_ENDPOINT": "http://stigmer:8080",
            "SANDBOX_LANES_DRIVER_OPTIONS": "memroy=512m",
        },
        "unknown option 'memroy' for driver 'docker'; did you mean 'memory'?",
    ),
    ("a reap interval that is no number", {"SANDBOX_LANES_REAP_INTERVAL_S": "abc"}, "is not a number"),
    (
        "a misspelled setting",
        {"SANDBOX_LANES_REPLICATON": "3"},
        "unknown setting 'SANDBOX_LANES_REPLICATON'; did you mean 'SANDBOX_LANES_REPLICATION'?",
    ),
    (
        "a misspelled upstream setting",
        {"STIGMER_SANDBOX_BACKEND_ENDPONT": "http://stigmer:8080"},
        "did you mean 'STIGMER_SANDBOX_BACKEND_ENDPOINT'?",
    ),
]


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "STIGMER_", "KUBE"))}
    return subprocess.run(
        [sys.executable, "-m", "consumers.tools.cli", *argv],
        env={
            **base,
            "PYTHONPATH": str(ROOT),
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",  # nothing listens: a start would fail later
            "SANDBOX_LANES_HTTP_PORT": "0",
            "STIGMER_ACTIVITY_ROUTING": "session",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("what", "env", "needle"), REFUSED, ids=[c[0] for c in REFUSED])
def test_config_check_and_run_refuse_the_same_in_one_line_with_exit_2(
    what: str, env: dict[str, str], needle: str
) -> None:
    check, run = _cli(env, "config", "check"), _cli(env, "run")
    for proc in (check, run):
        assert proc.returncode == 2, (what, proc.stderr)
        (line,) = proc.stderr.splitlines()  # one line, no traceback
        assert line.startswith("sandbox-lanes: configuration error: ") and needle in line, line
    assert check.stderr == run.stderr


def test_config_check_builds_the_driver_without_touching_anything(tmp_path: Path) -> None:
    """local-process: the factory validates its options; its state dir is not even created."""
    state = tmp_path / "sandboxes"
    ok = _cli(
        {
            "SANDBOX_PROVISIONER_TYPE": "local-process",
            "SANDBOX_LANES_DRIVER_OPTIONS": f"state_dir={state},grace_seconds=5",
        },
        "config",
        "check",
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "configuration ok: driver 'local-process', 0 warning(s)"
    assert not state.exists()
    bad = _cli(
        {"SANDBOX_PROVISIONER_TYPE": "local-process", "SANDBOX_LANES_DRIVER_OPTIONS": "grace_seconds=soon"},
        "config",
        "check",
    )
    assert bad.returncode == 2 and "grace_seconds" in bad.stderr, bad.stderr


def test_unknown_names_refused_or_warned_and_legit_dynamic_names_passed() -> None:
    settings = load_settings(
        {
            "STIGMER_TEMPORAL_API_KEY": "k",  # the server's Temporal connection: handed to runners
            "STIGMER_SANDBOX_RUNNER_ENV": "STIGMER_EXTRA_FLAG",  # a listed runner name
            "STIGMER_EXTRA_FLAG": "1",
            "SANDBOX_LANES_FORBID_SKIPS": "1",  # the dev tools' own
            "STIGMER_SERVER_URL": "http://x",  # upstream's server reads more STIGMER_* names: warned
            # Kubernetes service links of a Service `sandbox-lanes-metrics` (enableServiceLinks)
            "SANDBOX_LANES_METRICS_SERVICE_HOST": "10.0.0.1",
            "SANDBOX_LANES_METRICS_SERVICE_PORT_METRICS": "8080",
            "SANDBOX_LANES_METRICS_PORT": "tcp://10.0.0.1:8080",
            "SANDBOX_LANES_METRICS_PORT_8080_TCP_ADDR": "10.0.0.1",
        }
    )
    assert settings.warnings == ("STIGMER_SERVER_URL is not a setting of this pod; ignored",)
    with pytest.raises(ConfigError, match="unknown setting 'SANDBOX_LANES_SHINY'"):
        load_settings({"SANDBOX_LANES_SHINY": "1"})


def test_the_option_table_covers_every_key_a_driver_reads() -> None:
    """drivers/registry.py BUILT_IN_OPTION_KEYS against the literal keys the drivers' sources read."""
    import re

    from drivers.registry import BUILT_IN_OPTION_KEYS

    sources = {
        "local-process": ["local_process.py"],
        "docker": ["docker.py"],
        "kubernetes": ["kubernetes/driver.py", "kubernetes/manifests.py"],
        "agent-sandbox": [
            "kubernetes/driver.py",
            "kubernetes/manifests.py",
            "agent_sandbox/driver.py",
            "agent_sandbox/manifests.py",
            "agent_sandbox/idle.py",
        ],
    }
    read = re.compile(r"""(?:options|\bo)(?:\.get\(|\[)\s*"([a-z_]+)"|"([a-z_]+)" in o\b""")
    for driver, files in sources.items():
        text = "".join((ROOT / "drivers" / f).read_text() for f in files)
        keys = {a or b for a, b in read.findall(text)}
        if driver in ("kubernetes", "agent-sandbox"):
            keys |= {"cpu_request", "memory_request", "cpu_limit", "memory_limit"}  # DEFAULT_RESOURCES
        if driver == "agent-sandbox":
            keys |= {"suspend_after_seconds", "sweep_interval_seconds"}  # agent_sandbox.idle's constants
        assert keys <= BUILT_IN_OPTION_KEYS[driver], (driver, keys - BUILT_IN_OPTION_KEYS[driver])


def test_config_show_and_check_take_the_config_flag_after_the_subcommand(tmp_path: Path) -> None:
    path = tmp_path / "after.yaml"
    path.write_text("SANDBOX_LANES_GROUP_ID: after-subcommand\n")
    shown = _cli({}, "config", "show", "--config", str(path))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["SANDBOX_LANES_GROUP_ID"] == "after-subcommand"
    checked = _cli({}, "config", "check", "--config", str(path))
    assert checked.returncode == 0, checked.stderr


def test_the_installation_defaults_to_the_consumer_group_and_must_be_a_label_value() -> None:
    assert load_settings({}).driver.installation == "sandbox-lanes"
    assert load_settings({"SANDBOX_LANES_GROUP_ID": "lanes-staging"}).driver.installation == "lanes-staging"
    both = {"SANDBOX_LANES_GROUP_ID": "lanes-staging", "SANDBOX_LANES_INSTALLATION": "staging"}
    assert load_settings(both).driver.installation == "staging"
    with pytest.raises(ConfigError, match="SANDBOX_LANES_INSTALLATION: installation 'eu/prod' is not usable"):
        load_settings({"SANDBOX_LANES_INSTALLATION": "eu/prod"})
    with pytest.raises(ConfigError, match=r"SANDBOX_LANES_GROUP_ID: .* \(set SANDBOX_LANES_INSTALLATION\)"):
        load_settings({"SANDBOX_LANES_GROUP_ID": "lanes:staging"})
