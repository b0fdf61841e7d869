"""``k3 up --expert-pools 2`` as real processes: served tokens equal the local-experts model, and the pool set
changes while traffic flows (a third pool joins, a started one leaves and is stopped) with no failed request."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from test_up import Output, _gone, _pids

from k3.cli import main as cli_main
from k3.model.generate import generate
from k3.protos.v1 import experts_pb2, experts_pb2_grpc, inference_pb2, inference_pb2_grpc
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.experts.pool_set import read_pool_set
from k3.services.launcher import LaunchConfig, Launcher

pytestmark = pytest.mark.timeout(420)

EOS = 2
CONFIG = """\
up: {stop_grace: 30, pool_drain_s: 2}
cache:
  server: {grace_seconds: 1}
experts:
  server: {grace_seconds: 2}
prefill:
  server: {grace_seconds: 1}
  model: {expert_pool_client: {watch_interval_s: 0.3, replan_interval_s: 2}}
decode:
  server: {grace_seconds: 1}
  engine: {max_context: 4096, max_slots: 8, max_batch: 8}
  model: {expert_pool_client: {watch_interval_s: 0.3, replan_interval_s: 2}}
router:
  server: {grace_seconds: 1}
"""


def _generate(stub, prompt: list[int], max_tokens: int = 4) -> list[int]:
    responses = stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens)), timeout=120)
    return [t for r in responses for t in r.token_ids]


def _pool_rows(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return experts_pb2_grpc.ExpertPoolStub(channel).PoolStats(experts_pb2.PoolStatsRequest(), timeout=10).rows


def test_up_with_expert_pools_equals_local_and_reconfigures_under_traffic(tmp_path):
    torch.set_num_threads(1)
    config = tmp_path / "up.yaml"
    config.write_text(CONFIG)
    pool_file = tmp_path / "pools.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3", "up", "--preset", "tiny", "--expert-pools", "2", "--expert-pool-file",
         str(pool_file), "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = Output(proc)
    extra = Launcher(LaunchConfig(preset="tiny", stop_grace=10), emit=lambda line: None)
    try:
        match = output.until(r"k3 up: router listening on (\S+)")
        assert match is not None, "\n".join(output.lines)
        router = match.group(1)
        text = "\n".join(output.lines)
        assert f"k3 up: expert pool set in {pool_file}" in text
        pools = read_pool_set(pool_file)
        assert len(pools) == 2 and all(f"ready on {a}" in text for a in pools)
        assert set(_pids(output.lines)) == {"cache", "experts0", "experts1", "prefill", "decode", "router"}
        assert re.search(r"started experts0 \(pid \d+\) for shard 0/2", text)
        assert re.search(r"started experts1 \(pid \d+\) for shard 1/2", text)

        # Greedy tokens equal the single-process model computing its experts locally (same preset and seed).
        local = ModelSourceConfig(preset="tiny").load()[0]
        rng = random.Random(0)
        prompts = [[rng.randrange(8, 264) for _ in range(n)] for n in (5, 23, 40)]
        expected = {tuple(p): generate(local, p, 4, stop_token_ids=[EOS]).token_ids for p in prompts}
        channel = grpc.insecure_channel(router)
        stub = inference_pb2_grpc.InferenceStub(channel)
        for prompt in prompts:
            assert _generate(stub, prompt) == expected[tuple(prompt)]
        assert all(_pool_rows(a) > 0 for a in pools)  # both pools computed experts

        # Traffic flows while the pool set changes.
        errors: list[str] = []
        done = [0]
        stop = threading.Event()

        def traffic(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                prompt = pick.choice(prompts)
                try:
                    got = _generate(stub, prompt)
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")
                    continue
                if got != expected[tuple(prompt)]:
                    errors.append(f"tokens {got} != {expected[tuple(prompt)]}")
                done[0] += 1

        def wait_for(condition, what: str, timeout: float = 120) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                assert not errors, errors[:3]
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.2)

        threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        third = extra.spawn_pool(0, 2)  # a second pool for shard 0, started outside k3 up
        extra.await_ready(third)
        assert cli_main(["experts", "pools", "--file", str(pool_file), "--add", third.address]) == 0
        wait_for(lambda: _pool_rows(third.address) > 0, "the added pool to take work")
        seen = done[0]
        wait_for(lambda: done[0] >= seen + 3, "requests after the pool joined")
        # A pool k3 up started leaves the set: the workers stop using it, k3 up stops its process.
        assert cli_main(["experts", "pools", "--file", str(pool_file), "--remove", pools[0]]) == 0
        assert output.until(rf"experts0 \({pools[0]}\) stopped after leaving the pool set", timeout=120)
        seen = done[0]
        wait_for(lambda: done[0] >= seen + 4, "requests after the pool left")
        stop.set()
        for t in threads:
            t.join(180)
        assert not errors, errors[:3]
        assert done[0] >= 7
        assert read_pool_set(pool_file) == [pools[1], third.address]
        assert proc.poll() is None  # the platform is still up

        # Every pool dies: a request fails alone with UNAVAILABLE, the platform stays up and serves again as
        # soon as the pool set names a live pool.
        os.kill(_pids(output.lines)["experts1"], signal.SIGKILL)
        third.proc.kill()
        with pytest.raises(grpc.RpcError) as info:
            _generate(stub, prompts[0])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "expert pool" in info.value.details(), info.value.details()
        assert output.until(r"experts1 \(\S+\) exited with status -9; the workers retry its work", timeout=60)
        assert proc.poll() is None
        replacement = extra.spawn_pool(0, 1)  # one pool hosting every expert
        extra.await_ready(replacement)
        assert cli_main(["experts", "pools", "--file", str(pool_file), "--set", replacement.address]) == 0
        deadline = time.monotonic() + 60
        while True:
            try:
                assert _generate(stub, prompts[1]) == expected[tuple(prompts[1])]
                break
            except grpc.RpcError as exc:  # until the workers read the new set
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(0.5)

        proc.send_signal(signal.SIGINT)
        lines = output.rest()
        assert proc.wait(timeout=90) == 0, "\n".join(lines)
        assert all(_gone(pid) for pid in _pids(lines).values())
        channel.close()
    finally:
        extra.stop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
