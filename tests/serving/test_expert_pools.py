"""Expert pools over real gRPC (loopback): remote experts equal local ones, membership changes, failures,
bad inputs, statistics (tiny preset, fp32)."""

from __future__ import annotations

import contextlib
import json
import threading

import grpc
import numpy as np
import pytest
import torch
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from k3.cli import main as cli_main
from k3.model.generate import generate
from k3.protos.v1 import experts_pb2, experts_pb2_grpc
from k3.services.common import tensors
from k3.services.common.client import error_detail
from k3.services.common.config import ConfigError, ServerConfig, load_config
from k3.services.common.errors import Unavailable
from k3.services.common.server import start_server
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.experts.client import ExpertPoolClient, PoolClientConfig, attach_pools, detach_pools
from k3.services.experts.placement import adopters, home_placement, parse_shard, plan_placement
from k3.services.experts.service import ExpertsService, ExpertsServiceConfig
from k3.services.registry import get_spec

pytestmark = pytest.mark.timeout(240)

SOURCE = ModelSourceConfig(preset="tiny", seed=7)
MOE_LAYER = 1  # tiny: layer 0 is dense, 1..7 are MoE; E = 8, top-2, shards of 4 experts when n = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is dominated by per-op overhead: one intra-op thread is faster and shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def start_pool(shard: str, telemetry: Telemetry | None = None):
    config = ExpertsServiceConfig(server=ServerConfig(port=0, grace_seconds=0.2), model=SOURCE, shard=shard)
    telemetry = telemetry or Telemetry()
    return start_server(ExpertsService(config, telemetry=telemetry), config.server, telemetry=telemetry)


def stub(handle) -> experts_pb2_grpc.ExpertPoolStub:
    return experts_pb2_grpc.ExpertPoolStub(grpc.insecure_channel(handle.address))


@pytest.fixture(scope="module")
def local_model():
    return SOURCE.load()[0]


@pytest.fixture(scope="module")
def pools():
    handles = [start_pool("0/2"), start_pool("1/2")]
    yield handles
    for handle in handles:
        handle.stop(0)


def layer_inputs(model, tokens: int = 10, seed: int = 0, favour: tuple[int, ...] = ()):
    """(moe, z, ids, weights) of one MoE layer on random inputs; ``favour`` biases routing to those experts."""
    moe = model.layers[MOE_LAYER].ffn
    x = torch.randn(tokens, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    bias = moe.expert_bias.clone()
    try:
        for e in favour:
            moe.expert_bias[e] = 10.0
        with torch.no_grad():
            weights, ids, _ = moe.route(x)
            z = moe.w_down(x)
    finally:
        moe.expert_bias.copy_(bias)
    return moe, z, ids, weights


# -- placement (pure) --------------------------------------------------------------------------------------
def test_parse_shard_and_errors():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "-1/2", "x", "1", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_split_covers_every_row_once_and_moonep_balances():
    load = np.array([40, 30, 0, 2, 1, 1, 1, 5])  # shard 0 (experts 0-3) is overloaded
    placement = plan_placement(load, 2)
    # MoonEP: exactly CAP = 80 / 2 on each shard; the idle expert 2 keeps a unit share at home.
    assert placement.shares[load > 0].sum(axis=0).tolist() == [40, 40]
    assert placement.shares[2].tolist() == [1, 0]
    assert placement.replicas(1) and set(placement.replicas(1)) <= {0, 1, 3}
    assert placement.replicas(0) == []
    pieces = placement.split(load.tolist())
    covered = {e: [] for e in range(8)}
    for shard in pieces:
        for expert, start, count in shard:
            covered[expert].append((start, count))
    for expert, count in enumerate(load.tolist()):
        spans = sorted(covered[expert])
        assert sum(c for _, c in spans) == count
        assert all(a + c == b for (a, c), (b, _) in zip(spans, spans[1:], strict=False))
    assert [sum(c for _, _, c in shard) for shard in pieces] == [40, 40]
    assert home_placement(8, 2).replicas(1) == []
    assert adopters([True, False, False, True]) == [0, 3, 3, 3]
    assert adopters([False, False]) == [None, None]


# -- equivalence -------------------------------------------------------------------------------------------
def test_prefill_decode_with_remote_experts_equal_local(local_model, pools):
    source = ModelSourceConfig(preset="tiny", seed=7, expert_pools=[h.address for h in pools])
    remote, _ = source.load()
    try:
        prompt = torch.tensor([[3, 17, 99, 4, 250, 8]])
        with torch.no_grad():
            want, want_state = local_model.prefill(prompt)
            got, got_state = remote.prefill(prompt)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            step_want, _ = local_model.decode(torch.tensor([5]), [want_state])
            step_got, _ = remote.decode(torch.tensor([5]), [got_state])
            torch.testing.assert_close(step_got, step_want, rtol=0, atol=1e-6)
        prompt_ids = [3, 17, 99, 4, 250, 8]
        assert generate(remote, prompt_ids, 3).token_ids == generate(local_model, prompt_ids, 3).token_ids
        stats = remote.expert_pool_client.stats()
        assert all(p["live"] and p["rows"] > 0 for p in stats["pools"])
        assert sum(stats["expert_load"][MOE_LAYER]) > 0
    finally:
        detach_pools(remote)


def test_moonep_replicas_fetched_from_home_pool_keep_results_exact(local_model, pools):
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("client", ServerConfig(), metric_reader=reader)
    client = ExpertPoolClient([h.address for h in pools], PoolClientConfig(replan_interval_s=0),
                              config_hash=local_model.cfg.config_hash(), telemetry=telemetry)
    try:
        # Experts 0 and 1 (home: shard 0) get every entry, so MoonEP moves half of the load to shard 1.
        moe, z, ids, weights = layer_inputs(local_model, tokens=12, seed=1, favour=(0, 1))
        assert set(ids.flatten().tolist()) == {0, 1}
        want = moe._local_experts(z, ids, weights)
        torch.testing.assert_close(client.compute(moe, z, ids, weights), want, rtol=0, atol=0)
        client.replan()
        assert client.stats()["replicas"][MOE_LAYER] == {1: [0]}  # expert 0's 12 entries go to shard 1
        before = stub(pools[1]).PoolStats(experts_pb2.PoolStatsRequest(), timeout=5)
        torch.testing.assert_close(client.compute(moe, z, ids, weights), want, rtol=0, atol=0)
        after = stub(pools[1]).PoolStats(experts_pb2.PoolStatsRequest(), timeout=5)
        replica_rows = {(x.layer, x.expert): x.rows for x in after.loads if x.replica}
        assert after.replicas >= 1 and sum(replica_rows.values()) > 0
        assert after.rows - before.rows == 12  # half of 24 entries, computed on replicas of shard 0's experts
        assert client.stats()["shard_imbalance"] < 2.0
        names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics}
        assert {"k3.experts.client.rows", "k3.experts.client.imbalance", "k3.experts.client.replicas"} <= names
    finally:
        client.close()
        for handle in pools:  # leave the shared pools without replicas
            stub(handle).Replicate(experts_pb2.ReplicateRequest(drop=[
                experts_pb2.ExpertRef(layer=layer, expert=e) for layer in range(1, 8) for e in range(8)
                if e // 4 != handle.service.pool.shard_index]), timeout=10)


# -- membership and failures -------------------------------------------------------------------------------
def test_pools_added_and_removed_while_traffic_flows(local_model):
    a, b = start_pool("0/2"), start_pool("1/2")
    c = None
    client = ExpertPoolClient([a.address, b.address], PoolClientConfig(replan_interval_s=0))
    moe, z, ids, weights = layer_inputs(local_model, tokens=8, seed=2)
    want = moe._local_experts(z, ids, weights)
    errors: list[BaseException] = []
    done = {"n": 0}
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                torch.testing.assert_close(client.compute(moe, z, ids, weights), want, rtol=0, atol=0)
                done["n"] += 1
            except BaseException as exc:  # noqa: BLE001 - every failure is reported by the test
                errors.append(exc)
                return

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        c = start_pool("0/2")  # a second pool for shard 0 joins mid-traffic
        client.set_pools([a.address, b.address, c.address])
        seen = done["n"]
        while done["n"] < seen + 6 and not errors:
            stop.wait(0.05)
        client.set_pools([b.address, c.address])  # the original shard-0 pool leaves ...
        a.stop(1.0)  # ... and shuts down (its in-flight calls drain or are retried)
        seen = done["n"]
        while done["n"] < seen + 6 and not errors:
            stop.wait(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        client.close()
        for handle in (a, b, c):
            if handle is not None:
                handle.stop(0)
    assert not errors, errors[0]
    assert c.service.pool.stats().rows > 0  # the new pool took work
    assert done["n"] >= 12


def test_a_pool_retired_between_picking_and_calling_keeps_its_channel_for_that_call(local_model):
    # set_pools may retire a pool after a step has picked it but before the step calls it: the call must still
    # go out on the pool's channel (closed only once the step lets go of it), not fail on a closed channel.
    a, b = start_pool("0/2"), start_pool("1/2")
    c = start_pool("0/2")
    client = ExpertPoolClient([a.address, b.address], PoolClientConfig(replan_interval_s=0))
    moe, z, ids, weights = layer_inputs(local_model, tokens=8, seed=3)
    want = moe._local_experts(z, ids, weights)
    picked = client._assign

    def assign_then_retire(todo, failures):
        groups = picked(todo, failures)
        client.set_pools([b.address, c.address])  # a is retired while the step holds it
        return groups

    try:
        retired = client._pools[a.address]
        client._assign = assign_then_retire
        torch.testing.assert_close(client.compute(moe, z, ids, weights), want, rtol=0, atol=0)
        assert retired.retired and retired.in_flight == 0
        assert a.service.pool.stats().rows > 0  # the retired pool did take that step's shard-0 rows
        with pytest.raises(ValueError, match="closed channel"):  # and its channel was closed afterwards
            retired.stub.PoolStats(experts_pb2.PoolStatsRequest(), timeout=5)
        client._assign = picked
        torch.testing.assert_close(client.compute(moe, z, ids, weights), want, rtol=0, atol=0)
    finally:
        client.close()
        for handle in (a, b, c):
            handle.stop(0)


@pytest.mark.timeout(120)
def test_pool_dying_mid_step_is_retried_elsewhere_and_all_dead_is_unavailable(local_model):
    a, b = start_pool("0/2"), start_pool("1/2")
    remote = SOURCE.load()[0]
    client = attach_pools(remote, [a.address, b.address], PoolClientConfig(replan_interval_s=0, call_timeout_s=5))
    try:
        # Kill shard 1's only pool when layer 4 starts: layers 1-3 used it, 4-7 must recover without it.
        layer4 = remote.layers[4].ffn
        hook = layer4.routed_compute

        def kill_then_compute(moe, z, ids, weights):
            if not b.wait(0):
                b.stop(0)
            return hook(moe, z, ids, weights)

        layer4.routed_compute = kill_then_compute
        prompt = torch.tensor([[9, 8, 7, 6, 5]])
        with torch.no_grad():
            got, _ = remote.prefill(prompt)
            want, _ = local_model.prefill(prompt)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        stats = client.stats()
        assert stats["retries"] > 0
        assert [p["live"] for p in stats["pools"]] == [True, False]
        # With its home pool dead, pool A read shard 1's experts from its own model source.
        assert a.service.pool.stats().replicas > 0
        a.stop(0)
        with pytest.raises(Unavailable, match="no live expert pool") as info:
            with torch.no_grad():
                remote.prefill(prompt)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert a.address in str(info.value) and b.address in str(info.value)
    finally:
        detach_pools(remote)
        a.stop(0)
        b.stop(0)


def test_no_reachable_pool_is_a_clear_error(local_model):
    moe, z, ids, weights = layer_inputs(local_model, tokens=2)
    client = ExpertPoolClient(["127.0.0.1:1"], PoolClientConfig(probe_timeout_s=2, replan_interval_s=0))
    try:
        with pytest.raises(Unavailable, match=r"no expert pool is reachable: 127\.0\.0\.1:1 down"):
            client.compute(moe, z, ids, weights)
    finally:
        client.close()


def test_pool_of_another_model_is_refused(pools, local_model):
    with pytest.raises(ValueError, match="serves another model"):
        ExpertPoolClient([pools[0].address], config_hash="0" * 64)


# -- bad inputs --------------------------------------------------------------------------------------------
def compute_error(pool, **fields) -> tuple[grpc.StatusCode, str, str, str]:
    request = dict(layer=MOE_LAYER, expert_ids=[0], counts=[1], tokens=tensors.to_proto(torch.zeros(1, 64)))
    request.update(fields)
    with pytest.raises(grpc.RpcError) as info:
        stub(pool).Compute(experts_pb2.ExpertComputeRequest(**request), timeout=10)
    detail = error_detail(info.value)
    return info.value.code(), detail.field, detail.reason, detail.message


def test_compute_rejects_bad_inputs(pools):
    pool = pools[0]  # shard 0/2: experts 0..3
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert compute_error(pool, layer=0)[:3] == (invalid, "layer", "UNKNOWN_LAYER")
    assert compute_error(pool, layer=99)[:3] == (invalid, "layer", "UNKNOWN_LAYER")
    assert compute_error(pool, expert_ids=[8])[:3] == (invalid, "expert_ids[0]", "UNKNOWN_EXPERT")
    code, field, reason, message = compute_error(pool, expert_ids=[0, 6], counts=[1, 0])
    assert (code, field, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "expert_ids[1]", "EXPERT_NOT_HOSTED")
    assert "expert 6 of layer 1" in message and "0/2" in message
    assert compute_error(pool, expert_ids=[0, 0], counts=[1, 0])[:3] == (invalid, "expert_ids[1]",
                                                                        "DUPLICATE_EXPERT")
    assert compute_error(pool, counts=[1, 2])[:3] == (invalid, "counts", "COUNTS_MISMATCH")
    assert compute_error(pool, counts=[-1])[:3] == (invalid, "counts[0]", "BAD_COUNT")
    assert compute_error(pool, tokens=tensors.to_proto(torch.zeros(1, 63)))[:3] == (invalid, "tokens.shape",
                                                                                 "BAD_SHAPE")
    code, field, reason, message = compute_error(pool, tokens=tensors.to_proto(torch.zeros(2, 64)))
    assert (field, reason) == ("tokens.shape", "BAD_SHAPE") and "counts sum to 1" in message
    assert compute_error(pool, tokens=tensors.to_proto(torch.zeros(1, 64, dtype=torch.float16)))[:3] == (
        invalid, "tokens.dtype", "BAD_DTYPE")
    bad = experts_pb2.ExpertComputeRequest(layer=MOE_LAYER, expert_ids=[0], counts=[1])
    bad.tokens.dtype, bad.tokens.data = "float32", b"\0" * 3
    bad.tokens.shape.extend([1, 64])
    with pytest.raises(grpc.RpcError) as info:
        stub(pool).Compute(bad, timeout=10)
    assert error_detail(info.value).field == "tokens.data"
    with pytest.raises(grpc.RpcError) as info:
        stub(pool).FetchExpert(experts_pb2.FetchExpertRequest(layer=MOE_LAYER, expert=5), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:
        stub(pool).Replicate(experts_pb2.ReplicateRequest(drop=[experts_pb2.ExpertRef(layer=1, expert=2)]),
                             timeout=10)
    assert (info.value.code(), error_detail(info.value).reason) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                                    "HOME_EXPERT")


def test_config_validation_and_serve_flag(capsys):
    spec = get_spec("experts")
    config = load_config(spec.config_type, env={}, overrides={"shard": "1/2", "model.preset": "tiny"})
    assert config.shard == "1/2"
    with pytest.raises(ConfigError, match="shard") as info:
        load_config(spec.config_type, env={}, overrides={"shard": "2/2"})
    assert info.value.field == "shard"
    with pytest.raises(ConfigError) as info:
        ExpertsServiceConfig(model=ModelSourceConfig(preset="tiny", expert_pools=["x:1"]))
    assert info.value.field == "model.expert_pools"
    assert cli_main(["serve", "experts", "--shard", "3/2", "--port", "0"]) == 2
    assert "shard: shard '3/2'" in capsys.readouterr().err


# -- statistics --------------------------------------------------------------------------------------------
def test_experts_stats_command_and_pool_metrics(local_model, capsys):
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("experts", ServerConfig(), metric_reader=reader)
    a, b = start_pool("0/2", telemetry), start_pool("1/2")
    client = ExpertPoolClient([a.address, b.address], PoolClientConfig(replan_interval_s=0))
    try:
        moe, z, ids, weights = layer_inputs(local_model, tokens=6, seed=3)
        client.compute(moe, z, ids, weights)
        counts = torch.bincount(ids.flatten(), minlength=8).tolist()
        assert cli_main(["experts", "stats", "--pool", a.address, "--pool", b.address, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["expert_rows"] == counts
        assert [p["rows"] for p in report["pools"]] == [sum(counts[:4]), sum(counts[4:])]
        assert [p["shard"] for p in report["pools"]] == ["0/2", "1/2"]
        rows = [sum(counts[:4]), sum(counts[4:])]
        assert report["pool_imbalance"] == pytest.approx(max(rows) / (sum(rows) / 2), abs=1e-4)
        assert cli_main(["experts", "stats", "--pool", a.address, "--pool", b.address]) == 0
        text = capsys.readouterr().out
        assert a.address in text and "pool imbalance (max/mean rows)" in text and "replicas: 0" in text
        assert cli_main(["experts", "stats", "--pool", "127.0.0.1:1", "--timeout", "2"]) == 2
        assert "expert pool 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err
        metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                   for m in sm.metrics}
        rows_metric = sum(p.value for p in metrics["k3.experts.pool.rows"].data.data_points)
        assert rows_metric == sum(counts[:4])
        assert "k3.experts.pool.imbalance" in metrics and "k3.experts.pool.replicas" in metrics
    finally:
        client.close()
        with contextlib.suppress(Exception):
            a.stop(0)
        b.stop(0)


def test_checkpoint_source_reads_only_the_asked_experts(local_model, tmp_path):
    from safetensors.torch import save_model

    from k3.services.experts.weights import ExpertWeights

    save_model(local_model, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(local_model.cfg.to_json())
    weights = ExpertWeights(ModelSourceConfig(checkpoint=str(tmp_path)))
    got = weights.load([(3, 5), (1, 0)])
    assert sorted(got) == [(1, 0), (3, 5)]
    moe = local_model.layers[3].ffn
    assert torch.equal(got[(3, 5)][0], moe.w_in[5]) and torch.equal(got[(3, 5)][1], moe.w_out[5])
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer"):
        weights.load([(0, 1)])
