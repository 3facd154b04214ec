"""The optional configuration file: YAML (or JSON) or a ``.env`` file of the same variable names.

Chosen by ``SANDBOX_LANES_CONFIG_FILE`` (the CLI's global ``--config FILE`` sets it). Keys are the
environment variable names of the config table; the environment wins over the file, and an empty
environment value counts as unset (so the file's value applies). ``load_settings`` stays the one
loader: it merges the file under the environment and validates the result as a whole.

YAML values may be scalars (booleans become ``true``/``false``), lists (joined with commas, for the
``*_RUNNER_ENV``/``*_RUNNER_SECRETS`` name lists) or, for ``SANDBOX_LANES_DRIVER_OPTIONS``, a
mapping (joined as ``k=v,k=v``). A key of the pod's own prefix that is not a known knob is a typo and
fails; other upper-case names are passed through (e.g. the values of runner env names, or
``TEMPORAL_HOST_PORT``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

CONFIG_FILE_ENV = "SANDBOX_LANES_CONFIG_FILE"
_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_OWN_PREFIX = "SANDBOX_LANES_"
_YAML_SUFFIXES = (".yaml", ".yml", ".json")


class ConfigFileError(ValueError):
    """The file is missing, unreadable or malformed; the message names the file and the problem."""


def read_config_file(path: Path, known: Collection[str]) -> dict[str, str]:
    """The file's settings as environment strings. ``known``: the names of the config table."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"{CONFIG_FILE_ENV}={str(path)!r}: no such file") from None
    except OSError as exc:
        raise ConfigFileError(f"{CONFIG_FILE_ENV}={str(path)!r}: cannot be read: {exc.strerror}") from None
    parse = _from_yaml if path.suffix.lower() in _YAML_SUFFIXES else _from_dotenv
    values = parse(path, text)
    for name in values:
        if not _NAME.match(name):
            raise ConfigFileError(f"{path}: {name!r} is not an environment variable name (A-Z, 0-9, _)")
        if name.startswith(_OWN_PREFIX) and name not in known:
            raise ConfigFileError(f"{path}: unknown setting {name!r}{did_you_mean(name, known)}")
        if name == CONFIG_FILE_ENV:
            raise ConfigFileError(f"{path}: {CONFIG_FILE_ENV} cannot be set from the config file itself")
    return values


def merge(file_values: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The environment over the file; an empty environment value does not hide the file's."""
    merged = dict(environ)
    for name, value in file_values.items():
        if merged.get(name, "") == "":
            merged[name] = value
    return merged


def _from_yaml(path: Path, text: str) -> dict[str, str]:
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{path}: expected a mapping of VARIABLE: value at the top level")
    return {str(key).upper(): _scalar(path, str(key).upper(), value) for key, value in raw.items()}


def _scalar(path: Path, name: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict) and name == "SANDBOX_LANES_DRIVER_OPTIONS":
        return ",".join(f"{k}={_scalar(path, name, v)}" for k, v in value.items())
    raise ConfigFileError(
        f"{path}: {name} must be a string, number, boolean or list, not {type(value).__name__}"
    )


def _from_dotenv(path: Path, text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        stripped = stripped.removeprefix("export ").lstrip()
        name, sep, value = stripped.partition("=")
        if not sep:
            raise ConfigFileError(f"{path}:{number}: expected NAME=value")
        name, value = name.strip(), value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[name] = value
    return values


def did_you_mean(name: str, known: Collection[str]) -> str:
    """``; did you mean 'X'?`` for the closest known name, or ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""
