"""The committed generated code matches the protos, the check notices drift, and every module imports."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTOS = REPO / "protos"
GENERATE = PROTOS / "generate.py"


def _load_generate():
    spec = importlib.util.spec_from_file_location("k3_protos_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generate()


@pytest.mark.timeout(120)
def test_committed_code_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(GENERATE), "--check"], capture_output=True, text=True, cwd=REPO, timeout=110
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


@pytest.fixture
def proto_copy(tmp_path: Path) -> Path:
    """A copy of the contract and its committed generated code."""
    root = tmp_path / "protos"
    shutil.copytree(PROTOS / "k3", root / "k3", ignore=shutil.ignore_patterns("__pycache__"))
    assert gen.check(root) == []
    return root


@pytest.mark.timeout(120)
def test_check_reports_proto_changed_without_regeneration(proto_copy: Path):
    cache = proto_copy / "k3" / "v1" / "cache.proto"
    cache.write_text(cache.read_text() + "\nmessage AddedWithoutRegeneration { int32 x = 1; }\n")
    problems = gen.check(proto_copy)
    assert "stale: k3/v1/cache_pb2.py" in problems
    assert "stale: k3/v1/cache_pb2.pyi" in problems
    # Untouched protos still match.
    assert not any("common_pb2" in p for p in problems)
    # The CLI turns that into exit status 1 with the file list.
    result = subprocess.run(
        [sys.executable, str(GENERATE), "--check", "--root", str(proto_copy)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 1
    assert "stale: k3/v1/cache_pb2.py" in result.stderr
    # Regenerating fixes it.
    gen.generate(proto_copy, proto_copy)
    assert gen.check(proto_copy) == []


@pytest.mark.timeout(120)
def test_check_reports_missing_and_extra_files(proto_copy: Path):
    v1 = proto_copy / "k3" / "v1"
    (v1 / "vision_pb2_grpc.py").unlink()
    (v1 / "jobs.proto").unlink()
    problems = gen.check(proto_copy)
    assert "missing: k3/v1/vision_pb2_grpc.py" in problems
    assert {"extra: k3/v1/jobs_pb2.py", "extra: k3/v1/jobs_pb2.pyi", "extra: k3/v1/jobs_pb2_grpc.py"} <= set(problems)


def test_generation_error_leaves_output_untouched(proto_copy: Path):
    v1 = proto_copy / "k3" / "v1"
    before = (v1 / "cache_pb2.py").read_bytes()
    (v1 / "cache.proto").write_text((v1 / "cache.proto").read_text() + "\nmessage Broken { int32 = 1; }\n")
    with pytest.raises(gen.GenerationError, match="protoc failed"):
        gen.generate(proto_copy, proto_copy)
    assert (v1 / "cache_pb2.py").read_bytes() == before


def _generated_module_names() -> list[str]:
    files = gen.generated_files(PROTOS / "k3" / "v1")
    return sorted(f"k3.protos.v1.{p.stem}" for p in files if p.suffix == ".py")


def test_every_proto_has_generated_modules():
    stems = {p.stem for p in (PROTOS / "k3" / "v1").glob("*.proto")}
    names = set(_generated_module_names())
    assert names == {f"k3.protos.v1.{s}{suffix}" for s in stems for suffix in ("_pb2", "_pb2_grpc")}


@pytest.mark.parametrize("name", _generated_module_names())
def test_generated_module_imports(name: str):
    module = importlib.import_module(name)
    if name.endswith("_pb2"):
        # Descriptors are registered under the contract's own path, whatever the import path.
        assert module.DESCRIPTOR.name == f"k3/v1/{name.rsplit('.', 1)[1][: -len('_pb2')]}.proto"
        assert module.DESCRIPTOR.package == "k3.v1"
