"""Expert pools failing under a serving engine (real ``k3 serve experts`` processes killed mid-step), the pool
set file followed at runtime, the pools' Prometheus load gauge, and bad routings (tiny preset, fp32)."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import grpc
import pytest
import torch

from k3.cli import main as cli_main
from k3.model.generate import generate
from k3.protos.v1 import experts_pb2, experts_pb2_grpc
from k3.services.common.client import error_detail
from k3.services.common.config import ServerConfig
from k3.services.common.errors import InvalidArgument
from k3.services.common.server import start_server
from k3.services.engine import Engine, EngineConfig, SamplingOptions
from k3.services.engine.errors import ComputeUnavailable
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.experts.client import ExpertPoolClient, PoolClientConfig
from k3.services.experts.pool_set import PoolSetError, read_pool_set, write_pool_set
from k3.services.experts.service import ExpertsServiceConfig, build
from k3.services.experts.stats import BusyMeter
from k3.services.launcher import LaunchConfig, Launcher

pytestmark = pytest.mark.timeout(240)

CLIENT = PoolClientConfig(call_timeout_s=3, probe_timeout_s=3, replan_interval_s=0, watch_interval_s=0.2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_model():
    return ModelSourceConfig(preset="tiny").load()[0]


@pytest.fixture
def launcher():
    """Starts real pool processes (``k3 serve experts``, tiny preset, seed 0) and stops whatever is left."""
    lines: list[str] = []
    launcher = Launcher(LaunchConfig(preset="tiny", stop_grace=10), emit=lines.append)
    yield launcher
    launcher.stop()


def pools(launcher: Launcher, *shards: tuple[int, int]):
    children = [launcher.spawn_pool(i, n) for i, n in shards]
    for child in children:
        launcher.await_ready(child)
    return children


def kill(child) -> None:
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(timeout=30)


def freeze(child) -> None:
    """SIGSTOP: the pool's connections stay open but nothing answers (a hung pool)."""
    child.proc.send_signal(signal.SIGSTOP)


def at_layer(model, layer: int, action, calls: list[int], when: int) -> None:
    """Run ``action`` when layer ``layer``'s experts are asked for the ``when``-th time (mid-step)."""
    moe = model.layers[layer].ffn
    hook = model.expert_pool_client.compute

    def compute(moe_, z, ids, weights):
        calls.append(1)
        if len(calls) == when:
            action()
        return hook(moe_, z, ids, weights)

    moe.routed_compute = compute


def replicas(child) -> int:
    with grpc.insecure_channel(child.address) as channel:
        return experts_pb2_grpc.ExpertPoolStub(channel).PoolStats(experts_pb2.PoolStatsRequest(), timeout=10).replicas


def test_pool_killed_or_hung_mid_step_is_retried_and_no_pool_fails_only_that_step(launcher, local_model, tmp_path):
    a, b, b2 = pools(launcher, (0, 2), (1, 2), (1, 2))
    pool_file = tmp_path / "pools.json"
    write_pool_set(pool_file, [a.address, b.address, b2.address])
    remote = ModelSourceConfig(preset="tiny", expert_pools_file=str(pool_file), expert_pool_client=CLIENT).load()[0]
    engine = Engine(remote, EngineConfig(max_context=256, max_slots=4, max_batch=4, num_pages=64, parked_timeout_s=600))
    greedy = SamplingOptions(max_tokens=5)
    prompt = [5, 17, 99, 4, 250, 8]
    expected = generate(local_model, prompt, 5).token_ids
    try:
        # 1. One of shard 1's two pools is killed in the middle of a decode step: its pieces are retried on the
        #    other replica of the shard, and the tokens are unchanged.
        calls: list[int] = []
        at_layer(remote, 4, lambda: kill(b), calls, when=3)
        assert engine.generate(prompt, greedy).token_ids == expected
        assert len(calls) > 3 and b.proc.returncode == -signal.SIGKILL
        stats = remote.expert_pool_client.stats()
        assert stats["retries"] > 0 and [p["live"] for p in stats["pools"]] == [True, False, True]
        assert replicas(a) == 0  # shard 1 still had a pool: nothing was adopted

        # 2. Shard 1's last pool hangs mid-step: its calls end at the Compute deadline (nothing waits for
        #    ever), shard 0's pool adopts shard 1 (replicas read from its own model source), tokens unchanged.
        calls.clear()
        at_layer(remote, 4, lambda: freeze(b2), calls, when=2)
        assert engine.generate(prompt, greedy).token_ids == expected
        assert "DEADLINE_EXCEEDED" in remote.expert_pool_client.stats()["pools"][2]["error"]
        assert replicas(a) > 0
        kill(b2)

        # 2. A handed-off state is parked (not in any step) when the last pool dies mid-step under a running
        #    request: that request alone fails with UNAVAILABLE, the engine keeps serving.
        parked_prompt = [7, 7, 8, 9]
        with torch.no_grad():
            logits, state = local_model.prefill(torch.tensor(parked_prompt))
        engine.load_state("parked", state, logits[-1], parked_prompt)
        calls.clear()
        at_layer(remote, 4, lambda: kill(a), calls, when=2)
        doomed = engine.submit([3, 1, 4, 1, 5], greedy)
        with pytest.raises(ComputeUnavailable) as info:
            doomed.result()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "could not compute this request's step" in str(info.value) and a.address in str(info.value)
        assert not engine.closed and engine.is_parked("parked")

        # 3. New pools enter through the pool set file; the parked request and new ones complete, exactly.
        c, d = pools(launcher, (0, 2), (1, 2))
        write_pool_set(pool_file, [c.address, d.address])
        deadline = time.monotonic() + 30
        while {p["address"] for p in remote.expert_pool_client.stats()["pools"]} != {c.address, d.address}:
            assert time.monotonic() < deadline, "the pool set file change was not applied"
            time.sleep(0.1)
        resumed = engine.resume("parked", greedy).result()
        assert resumed.token_ids[:1] == [int(logits[-1].argmax())]
        assert engine.generate(prompt, greedy).token_ids == expected
        # A malformed edit is reported and ignored: the workers keep their pools.
        pool_file.write_text("{not json")
        time.sleep(0.6)
        assert engine.generate(prompt, greedy).token_ids == expected
    finally:
        engine.close()
        remote.expert_pool_client.close()


def test_pool_set_file_and_cli(tmp_path, capsys):
    path = tmp_path / "pools.json"
    write_pool_set(path, ["127.0.0.1:1", "127.0.0.1:2"])
    assert cli_main(["experts", "pools", "--file", str(path), "--add", "127.0.0.1:3", "--remove", "127.0.0.1:1"]) == 0
    assert capsys.readouterr().out.strip() == '{"pools": ["127.0.0.1:2", "127.0.0.1:3"]}'
    assert read_pool_set(path) == ["127.0.0.1:2", "127.0.0.1:3"]
    assert cli_main(["experts", "pools", "--file", str(path), "--remove", "127.0.0.1:9"]) == 2
    assert "not in the pool set" in capsys.readouterr().err
    assert cli_main(["experts", "pools", "--file", str(path), "--set", "127.0.0.1:2",
                     "--remove", "127.0.0.1:2"]) == 2
    assert "would be empty" in capsys.readouterr().err
    assert read_pool_set(path) == ["127.0.0.1:2", "127.0.0.1:3"]  # refused edits change nothing
    for text, match in (("[]", "must hold"), ('{"pools": ["a:1", ""]}', r"entry \[1\]"), ("{", "not JSON")):
        path.write_text(text)
        with pytest.raises(PoolSetError, match=match):
            read_pool_set(path)
    with pytest.raises(PoolSetError, match="cannot read"):
        read_pool_set(tmp_path / "missing.json")


def test_busy_meter_averages_calls_in_progress():
    now = [100.0]
    meter = BusyMeter(window_s=10, clock=lambda: now[0])
    now[0] = 102.0
    assert meter.load() == 0.0
    meter.enter()
    now[0] = 104.0
    assert meter.load() == pytest.approx(2 / 4)  # busy 2 s of the 4 s since start
    meter.enter()  # a second call overlaps
    now[0] = 105.0
    meter.exit()
    meter.exit()
    assert meter.load() == pytest.approx((2 + 2) / 5)
    now[0] = 120.0  # the window [110, 120] saw no call
    assert meter.load() == 0.0
    meter.enter()
    now[0] = 125.0
    assert meter.load() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        BusyMeter(window_s=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_load(url: str) -> float:
    """The one ``k3_expert_pool_load`` sample of the pool's /metrics (the HPAs' metric name, exactly)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = [line for line in text.splitlines() if line.startswith("k3_expert_pool_load{")]
    assert len(samples) == 1 and 'shard="0/1"' in samples[0], text
    return float(samples[0].rsplit(" ", 1)[1])


def test_pool_exports_its_load_for_the_autoscaler(local_model):
    port = _free_port()
    config = ExpertsServiceConfig(server=ServerConfig(port=0, grace_seconds=0.2, metrics_port=port),
                                  model=ModelSourceConfig(preset="tiny"), shard="0/1", load_window_s=30)
    service = build(config)
    handle = start_server(service, config.server, telemetry=service.telemetry)
    client = ExpertPoolClient([handle.address], CLIENT)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert _scrape_load(url) == 0.0
        moe = local_model.layers[1].ffn
        x = torch.randn(64, local_model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            weights, ids, _ = moe.route(x)
            z = moe.w_down(x)
        for _ in range(5):
            client.compute(moe, z, ids, weights)
        value = _scrape_load(url)
        assert 0.0 < value <= 1.0  # one caller: at most one call at a time
        assert value == pytest.approx(service.pool.busy.load(), rel=0.5)
    finally:
        client.close()
        handle.stop(0)


def test_bad_routings_are_refused_precisely(local_model):
    config = ExpertsServiceConfig(server=ServerConfig(port=0, grace_seconds=0.2), model=ModelSourceConfig(preset="tiny"),
                                  shard="0/2")
    service = build(config)
    handle = start_server(service, config.server, telemetry=service.telemetry)
    client = ExpertPoolClient([handle.address], CLIENT)
    stub = experts_pb2_grpc.ExpertPoolStub(grpc.insecure_channel(handle.address))
    try:
        moe = local_model.layers[1].ffn
        x = torch.randn(3, local_model.cfg.hidden_size)
        with torch.no_grad():
            weights, ids, _ = moe.route(x)
            z = moe.w_down(x)
        # Client side: a routing to an expert the layer does not have, or shapes that do not agree.
        with pytest.raises(InvalidArgument, match="routes to expert 8, which does not exist") as info:
            client.compute(moe, z, torch.full_like(ids, 8), weights)
        assert (info.value.field, info.value.reason) == ("ids", "UNKNOWN_EXPERT")
        with pytest.raises(InvalidArgument, match="routes to expert -1"):
            client.compute(moe, z, torch.full_like(ids, -1), weights)
        with pytest.raises(InvalidArgument, match=r"must be \[N, latent\], \[N, 2\], \[N, 2\]") as info:
            client.compute(moe, z[:2], ids, weights)
        assert info.value.reason == "BAD_SHAPE"
        with pytest.raises(InvalidArgument, match="BAD_SHAPE|must be"):
            client.compute(moe, z, ids, weights[:, :1])
        # Pool side: replicas and fetches of experts or layers that do not exist.
        cases = [
            (stub.Replicate, experts_pb2.ReplicateRequest(add=[experts_pb2.ReplicaSpec(layer=1, expert=99)]),
             "add[0].expert", "UNKNOWN_EXPERT"),
            (stub.Replicate, experts_pb2.ReplicateRequest(drop=[experts_pb2.ExpertRef(layer=0, expert=5)]),
             "drop[0].layer", "UNKNOWN_LAYER"),
            (stub.FetchExpert, experts_pb2.FetchExpertRequest(layer=1, expert=-3), "expert", "UNKNOWN_EXPERT"),
            (stub.FetchExpert, experts_pb2.FetchExpertRequest(layer=42, expert=0), "layer", "UNKNOWN_LAYER"),
        ]
        for method, request, field, reason in cases:
            with pytest.raises(grpc.RpcError) as rpc:
                method(request, timeout=10)
            detail = error_detail(rpc.value)
            assert (rpc.value.code(), detail.field, detail.reason) == (grpc.StatusCode.INVALID_ARGUMENT, field,
                                                                       reason), request
        # Rows that are not a matrix.
        bad = experts_pb2.ExpertComputeRequest(layer=1, expert_ids=[0], counts=[4])
        bad.tokens.dtype, bad.tokens.data = "float32", b"\0" * 4 * 64 * 4
        bad.tokens.shape.extend([4, 8, 8])
        with pytest.raises(grpc.RpcError) as rpc:
            stub.Compute(bad, timeout=10)
        assert (rpc.value.code(), error_detail(rpc.value).reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_SHAPE")
        assert service.pool.stats().requests == 0  # nothing above was computed
    finally:
        client.close()
        handle.stop(0)


def test_launcher_pool_config_and_errors(tmp_path):
    from k3.services.common.config import ConfigError
    from k3.services.launcher import pool_config, service_config

    path = tmp_path / "up.yaml"
    path.write_text("up: {expert_pools: 2}\nexperts: {server: {metrics_port: 9400}, shard: 5/9, load_window_s: 5}\n")
    config = LaunchConfig.from_file(path, preset="tiny")
    assert config.expert_pools == 2
    assert pool_config(config, 1, 2) == {"server": {"metrics_port": 9401}, "load_window_s": 5,
                                         "model": {"preset": "tiny"}, "shard": "1/2"}
    wiring = {"cache": "127.0.0.1:1", "expert_pools_file": "/x/pools.json"}
    assert service_config("decode", config, wiring)["model"] == {"preset": "tiny", "tokenizer": "byte",
                                                                 "expert_pools_file": "/x/pools.json"}
    path.write_text("up: {expert_pools: -1}\n")
    with pytest.raises(ConfigError, match="up.expert_pools: must be an integer >= 0"):
        LaunchConfig.from_file(path)
    assert os.path.exists(path)
