"""The benchmark's JSON report: rewritten after every result, and never left half-written."""

import json

import pytest
import torch

from k3.kernels import bench as bench_module


def _bench(tmp_path):
    b = bench_module.Bench(quick=True, iters=1, only=None, json_path=str(tmp_path / "bench.json"))
    b.report.ceilings = {"copy_TBps": 4.0, "bf16_mm_TFLOPs": 800.0}
    return b


def _read(tmp_path):
    return json.loads((tmp_path / "bench.json").read_text())


def test_every_check_and_row_is_on_disk_as_soon_as_it_is_recorded(tmp_path):
    b = _bench(tmp_path)
    b.check_error("kda_chunk o (bf16)", 3.2e-3, torch.bfloat16)
    assert [c["check"] for c in _read(tmp_path)["checks"]] == ["kda_chunk o (bf16)"]
    assert _read(tmp_path)["rows"] == []

    b.add(bench_module.Row("kda_chunk fwd", "B8 T4096 H16 D128", 1.7, "fla chunk_kda", 2.0))
    b.check_error("kda_chunk dq (bf16)", float("nan"), torch.bfloat16)
    data = _read(tmp_path)
    assert [(r["kernel"], r["ratio_peer_over_ours"]) for r in data["rows"]] == [("kda_chunk fwd", pytest.approx(2.0 / 1.7))]
    assert [c["ok"] for c in data["checks"]] == [True, False]

    def broken():
        raise RuntimeError("no kernel image")

    b.guarded("mla_decode", broken)
    assert _read(tmp_path)["checks"][-1] == {"check": "mla_decode", "ok": False, "error": "RuntimeError: no kernel image"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_a_write_that_fails_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    b = _bench(tmp_path)
    b.check_error("situ_glu fwd (bf16)", 1e-3, torch.bfloat16)
    before = (tmp_path / "bench.json").read_text()

    def dump_half_then_fail(data, fh, **kwargs):
        fh.write('{"device": ')
        raise OSError("disk full")

    monkeypatch.setattr(bench_module.json, "dump", dump_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        b.check_error("situ_glu bwd (bf16)", 1e-3, torch.bfloat16)
    assert (tmp_path / "bench.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_without_a_path_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    b = bench_module.Bench(quick=True, iters=1, only=None)
    b.check_error("kda_decode (bf16)", 1e-3, torch.bfloat16)
    assert list(tmp_path.iterdir()) == []
