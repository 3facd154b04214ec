"""The layout's rules hold: the import contracts, and a product wheel without the dev tools.

* ``lint-imports`` (import-linter, contracts in pyproject.toml) over the real packages: the layers
  tools > ops > runtime > lanes, pure lanes, drivers/events never importing the pod, the product never
  importing the dev tools (harness, bench; no exception), the bench's modules without a cycle.
* The wheel built from the checkout holds only the product packages; ``pip install`` of it in a clean
  venv (no test extras, no dev tools): ``sandbox-lanes --help`` lists every product subcommand and not
  the bench, ``sandbox-lanes bench`` says where the bench comes from, ``import harness`` fails, and the
  in-memory test driver is not a selectable type.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_the_import_contracts_hold() -> None:
    proc = subprocess.run(
        [str(BIN / "lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "6 kept, 0 broken" in proc.stdout


def test_the_product_wheel_ships_without_the_harness_and_runs_without_test_extras(tmp_path: Path) -> None:
    # Built from a copy of what the Dockerfile copies: setuptools writes build/ next to its source.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("resilience", "consumers", "drivers", "events"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(src),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("sandbox_lanes-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {
        "resilience",
        "consumers",
        "drivers",
        "events",
    }
    # Every driver package is listed (pyproject [tool.setuptools] packages); the test driver is not in it.
    for package in ("drivers/kubernetes", "drivers/agent_sandbox", "drivers/runner"):
        assert f"{package}/__init__.py" in names, package
    # No in-memory *driver* (the state store's in-memory implementation is a product module).
    assert not [n for n in names if n.startswith("drivers/") and "memory" in n.rsplit("/", 1)[-1]], names
    assert "consumers/runtime/state/memory.py" in names and "consumers/runtime/kafka/sink.py" in names

    # `pip install` of the wheel in a clean venv, dependencies resolved from the package index
    # (pip's cache makes it quick), no test extras, no harness.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", str(wheel)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    help_ = subprocess.run(
        [str(env_dir / "bin" / "sandbox-lanes"), "--help"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
    )
    assert help_.returncode == 0, help_.stderr
    assert "replay" in help_.stdout and "bench" not in help_.stdout
    bench = subprocess.run(
        [str(env_dir / "bin" / "sandbox-lanes"), "bench", "--only", "rules"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
    )
    assert bench.returncode == 2, bench.stderr
    assert (
        "sandbox-lanes bench: the bench is a dev tool" in bench.stderr and "devtools[bench]" in bench.stderr
    )
    where = subprocess.run(
        [str(py), "-c", "import consumers, sys; print(consumers.__file__); import harness"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
    )
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout  # the wheel's copy, not the checkout
    assert "No module named 'harness'" in where.stderr
    # The in-memory test driver is registered by the dev harness only: not a production type.
    memory = subprocess.run(
        [str(env_dir / "bin" / "sandbox-lanes"), "config", "show"],
        cwd=tmp_path,
        env={**clean, "SANDBOX_PROVISIONER_TYPE": "memory"},
        capture_output=True,
        text=True,
    )
    assert memory.returncode != 0
    assert (
        "unknown sandbox provisioner type 'memory' — known types: "
        "'agent-sandbox', 'docker', 'kubernetes', 'local-process'" in (memory.stdout + memory.stderr)
    )
