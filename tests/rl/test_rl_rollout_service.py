"""``k3 serve rollout`` over real gRPC on loopback: start, status, stop, and the bad requests."""

import time

import grpc
import pytest
import torch
from rl_fixtures import SMALL_ENGINE, tiny_policy

from k3.protos.v1 import rollout_pb2, rollout_pb2_grpc
from k3.services.bus import open_bus
from k3.services.common.config import ServerConfig
from k3.services.common.server import start_server
from k3.services.rollout.codec import TRAJECTORIES_TOPIC, decode_trajectory
from k3.services.rollout.service import RolloutService, RolloutServiceConfig, RolloutSettings

torch.set_num_threads(1)


def test_rollout_service_publishes_trajectories_and_rejects_bad_requests(tmp_path):
    model, _, tok = tiny_policy()
    config = RolloutServiceConfig(server=ServerConfig(host="127.0.0.1", port=0), engine=SMALL_ENGINE,
                                  rollout=RolloutSettings(bus_url=f"embedded://{tmp_path / 'bus'}",
                                                          spool_dir=str(tmp_path / "spool"), max_staleness=0))
    handle = start_server(RolloutService(config, model, tok), config.server)
    try:
        stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(handle.address))
        for request, field in (
            (rollout_pb2.RolloutRequest(job_id="j", environment="nope", num_prompts=1, group_size=2), "environment"),
            (rollout_pb2.RolloutRequest(job_id="", environment="tool_use", num_prompts=1, group_size=2), "job_id"),
            (rollout_pb2.RolloutRequest(job_id="j", environment="tool_use", num_prompts=0, group_size=2),
             "num_prompts"),
            (rollout_pb2.RolloutRequest(job_id="j", environment="tool_use", num_prompts=1, group_size=1),
             "group_size"),
            (rollout_pb2.RolloutRequest(job_id="j", environment="tool_use", num_prompts=1, group_size=2,
                                        effort="huge"), "effort"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.StartRollouts(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.RolloutStatus(rollout_pb2.RolloutStatusRequest(job_id="unknown"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        ack = stub.StartRollouts(rollout_pb2.RolloutRequest(
            job_id="svc-job", environment="reasoning_gym/chain_sum", num_prompts=1, group_size=2, effort="low"))
        assert ack.accepted == 2
        with pytest.raises(grpc.RpcError) as info:
            stub.StartRollouts(rollout_pb2.RolloutRequest(
                job_id="other", environment="tool_use", num_prompts=1, group_size=2))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status = stub.RolloutStatus(rollout_pb2.RolloutStatusRequest(job_id="svc-job"))
            if status.published >= 2:
                break
            time.sleep(0.5)
        assert status.published == 2 and status.state == "RUNNING"  # the staleness bound (0) holds it at one batch
        stopped = stub.StopRollouts(rollout_pb2.RolloutStatusRequest(job_id="svc-job"))
        assert stopped.state == "STOPPED"
    finally:
        handle.stop()
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    consumer = bus.subscribe([TRAJECTORIES_TOPIC], group="check")
    consumer.seek_to_beginning()
    got = [decode_trajectory(r.value) for r in consumer.poll(timeout_s=1.0)]
    consumer.close()
    bus.close()
    assert {t.group_id for t in got} == {"svc-job/svc/g0"} and all(t.job_id == "svc-job" for t in got)
