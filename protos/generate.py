"""Generate the Python code of the gRPC contract from ``protos/k3/v1/*.proto``.

Usage::

    python protos/generate.py            # regenerate the committed files in protos/k3/v1/
    python protos/generate.py --check    # exit 1 and list the files that are stale, missing or extra

Design decisions:

- The ``.proto`` files are the single contract; the generated ``*_pb2.py``, ``*_pb2.pyi`` (type stubs) and
  ``*_pb2_grpc.py`` are committed so that installing k3 never needs protoc. ``--check`` keeps them honest:
  it regenerates into a temporary directory and compares byte for byte.
- protoc runs with ``-I <root>`` so descriptors are registered under ``k3/v1/<name>.proto`` and the
  generated code imports its siblings as ``from k3.v1 import x_pb2``. The folder ``protos/k3`` is installed
  as ``k3.protos`` (see setup.py), so those imports are rewritten to ``from k3.protos.v1 import x_pb2``.
- Output is deterministic: files are generated in sorted order, protoc writes no timestamps, and the pinned
  ``grpcio-tools`` (dev extra of pyproject.toml) fixes the compiler version.
- ``generate`` and ``check`` take the source and output directories as parameters so that tests can run
  them against a modified copy of the contract.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Protos live in <root>/k3/v1/; the package path inside the root is what the generated imports name.
PROTO_PACKAGE = Path("k3") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT_RE = re.compile(r"^from k3\.v1 import ", re.MULTILINE)


class GenerationError(RuntimeError):
    """protoc failed; the message carries its diagnostics."""


def proto_files(root: Path) -> list[Path]:
    """The ``.proto`` files of the contract under ``root``, sorted, relative to ``root``."""
    return sorted(p.relative_to(root) for p in (root / PROTO_PACKAGE).glob("*.proto"))


def generated_files(directory: Path) -> list[Path]:
    """Generated files found in ``directory`` (the ``k3/v1`` folder of an output root), sorted by name."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(GENERATED_SUFFIXES))


def _compile(root: Path, out: Path) -> list[Path]:
    """Run protoc on every ``<root>/k3/v1/*.proto`` into the empty folder ``out``; return the files written."""
    from grpc_tools import protoc  # dev-only dependency: import lazily so ``--help`` works without it

    sources = proto_files(root)
    if not sources:
        raise GenerationError(f"no .proto files in {root / PROTO_PACKAGE}")
    # grpc_tools bundles the well-known types (google/protobuf/*.proto); make them importable too.
    well_known = Path(protoc.__file__).parent / "_proto"
    # Relative source names resolved against ``-I root`` keep the descriptor names ("k3/v1/cache.proto")
    # independent of where the checkout lives.
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(s.as_posix() for s in sources),
    ]
    status = protoc.main(args)
    if status != 0:
        raise GenerationError(f"protoc failed with status {status} on {root / PROTO_PACKAGE}")
    written = generated_files(out / PROTO_PACKAGE)
    for path in written:
        path.write_text(_IMPORT_RE.sub("from k3.protos.v1 import ", path.read_text()))
    return written


def generate(root: Path = HERE, out: Path = HERE) -> list[Path]:
    """Compile every ``<root>/k3/v1/*.proto`` into ``<out>/k3/v1/`` and return the written files.

    Compilation happens in a temporary folder first, so a protoc error leaves ``out`` untouched. Generated
    files of protos that no longer exist are removed, so ``out`` mirrors the contract.
    """
    root, out = Path(root).resolve(), Path(out).resolve()
    target = out / PROTO_PACKAGE
    with tempfile.TemporaryDirectory(prefix="k3-protos-") as tmp:
        fresh = _compile(root, Path(tmp))
        target.mkdir(parents=True, exist_ok=True)
        for old in generated_files(target):
            old.unlink()
        written = []
        for path in fresh:
            dest = target / path.name
            dest.write_bytes(path.read_bytes())
            written.append(dest)
    return written


def check(root: Path = HERE, committed: Path | None = None) -> list[str]:
    """Regenerate ``root``'s protos into a temporary directory and compare with ``committed``.

    ``committed`` defaults to ``root`` (the generated files sit next to the protos). Returns one line per
    problem (``stale: k3/v1/cache_pb2.py``, ``missing: ...``, ``extra: ...``); empty means up to date.
    """
    root = Path(root).resolve()
    committed = Path(committed).resolve() if committed is not None else root
    with tempfile.TemporaryDirectory(prefix="k3-protos-") as tmp:
        fresh = {p.name: p for p in _compile(root, Path(tmp))}
        have = {p.name: p for p in generated_files(committed / PROTO_PACKAGE)}
        problems = []
        for name in sorted(fresh.keys() | have.keys()):
            rel = (PROTO_PACKAGE / name).as_posix()
            if name not in have:
                problems.append(f"missing: {rel}")
            elif name not in fresh:
                problems.append(f"extra: {rel}")
            elif not filecmp.cmp(fresh[name], have[name], shallow=False):
                problems.append(f"stale: {rel}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 if stale")
    parser.add_argument("--root", type=Path, default=HERE, help="folder holding k3/v1/*.proto (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="output root (default: same as --root)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.root
    try:
        if args.check:
            problems = check(args.root, out)
            if problems:
                print("generated protobuf code is out of date (run: python protos/generate.py):", file=sys.stderr)
                for line in problems:
                    print(f"  {line}", file=sys.stderr)
                return 1
            print("generated protobuf code is up to date")
            return 0
        for path in generate(args.root, out):
            print(path)
    except GenerationError as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
