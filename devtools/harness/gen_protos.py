"""Regenerate the Python code of the ``events/`` contracts with protoc from PyPI (grpcio-tools).

Reproducible: the protoc version is pinned through grpcio-tools in pyproject.toml,
and ``--check`` regenerates into a temp dir and diffs, so a test fails when the
committed code is stale.

    python -m harness.gen_protos          # write
    python -m harness.gen_protos --check  # exit 1 when the committed code differs
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # devtools/harness/ → the checkout
PROTO_DIR = ROOT / "events" / "sandbox_lanes" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto into ``out_root``; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--plugin=protoc-gen-mypy={Path(sys.executable).parent / 'protoc-gen-mypy'}",
        f"--python_out={out_root}",
        f"--mypy_out={out_root}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    rel = PROTO_DIR.relative_to(ROOT)
    return sorted((out_root / rel).glob("*_pb2.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when committed code is stale")
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale: list[str] = []
        for path in generated:
            target = PROTO_DIR / path.name
            if ns.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(path.name)
            else:
                shutil.copyfile(path, target)
        if ns.check:
            expected = {p.name for p in generated}
            extra = sorted(p.name for p in PROTO_DIR.glob("*_pb2.py*") if p.name not in expected)
            if stale or extra:
                print(f"stale generated code: {stale + extra}; run python -m harness.gen_protos")
                return 1
            print(f"generated code is current ({len(generated)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
