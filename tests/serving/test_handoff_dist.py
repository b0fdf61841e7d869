"""The torch.distributed (gloo) hand-off between real processes: same tokens as gRPC, failures stay local.

The decode worker runs in the test process with ``decode.handoff: dist``; the dist-mode prefill worker is a
``k3 serve prefill`` subprocess (the gRPC-mode reference runs in the test process), and a peer that dies mid-transfer is a subprocess that joins a pair group,
announces a state, gets ``ready`` and exits without sending it.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

from k3.model.generate import generate
from k3.model.multimodal import IMAGE_PLACEHOLDER_ID
from k3.protos.v1 import engine_pb2, engine_pb2_grpc, inference_pb2
from k3.services.common.client import error_detail
from k3.services.common.config import ConfigError, ServerConfig
from k3.services.common.server import start_server
from k3.services.common.tensors import to_proto
from k3.services.decode.config import DecodeServiceConfig, DecodeSettings
from k3.services.decode.service import DecodeService
from k3.services.engine.config import EngineConfig
from k3.services.engine.handoff_dist import DistHandoffConfig, pack, payload_layout, unpack, validate_header
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.prefill.config import PrefillServiceConfig, PrefillSettings
from k3.services.prefill.service import PrefillService
from k3.services.vision.keys import media_key_ids

pytestmark = pytest.mark.timeout(300)

SOURCE = ModelSourceConfig(preset="tiny", seed=0)
MAX_CONTEXT = 2048


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _read_line(proc: subprocess.Popen, marker: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if marker in line:
                return line
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"no {marker!r} from the subprocess: {proc.communicate()[1][-3000:]}")


def start_prefill(tmp_path, handoff: str) -> tuple[subprocess.Popen, str]:
    config = tmp_path / f"prefill-{handoff}.yaml"
    config.write_text(textwrap.dedent(f"""\
        server: {{grace_seconds: 0.5}}
        model: {{preset: tiny, seed: 0}}
        prefill: {{max_context: {MAX_CONTEXT}, prefill_chunk: 256, handoff: {handoff},
                  dist: {{backend: gloo, timeout_s: 20}}}}
        """))
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "prefill", "--config", str(config), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    return proc, _read_line(proc, "listening on").rsplit(" ", 1)[1].strip()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def decode():
    config = DecodeServiceConfig(
        server=ServerConfig(port=0, grace_seconds=0.5), model=SOURCE,
        engine=EngineConfig(max_batch=4, max_slots=4, page_size=16, num_pages=512, max_context=MAX_CONTEXT,
                            parked_timeout_s=120.0),
        decode=DecodeSettings(handoff="dist", dist=DistHandoffConfig(backend="gloo", timeout_s=20)))
    service = DecodeService(config)
    handle = start_server(service, config.server)
    channel = grpc.insecure_channel(handle.address)
    yield handle.address, engine_pb2_grpc.DecodeStub(channel), service
    channel.close()
    handle.stop(grace=0)


@pytest.fixture(scope="module")
def model():
    return SOURCE.load()[0]


@pytest.fixture(scope="module")
def prefills(tmp_path_factory, model):
    """The dist-mode prefill worker in its own process; the gRPC-mode one in this process (the reference)."""
    proc, address = start_prefill(tmp_path_factory.mktemp("prefill"), "dist")
    local = start_server(PrefillService(PrefillServiceConfig(
        server=ServerConfig(port=0, grace_seconds=0.5), model=SOURCE,
        prefill=PrefillSettings(max_context=MAX_CONTEXT, prefill_chunk=256)), model=model),
        ServerConfig(port=0, grace_seconds=0.5))
    channels = [grpc.insecure_channel(address), grpc.insecure_channel(local.address)]
    try:
        yield {"dist": engine_pb2_grpc.PrefillStub(channels[0]), "grpc": engine_pb2_grpc.PrefillStub(channels[1])}
    finally:
        for channel in channels:
            channel.close()
        local.stop(grace=0)
        proc.kill()
        proc.communicate()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(8, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(prefill_stub, decode, request_id: str, ids: list[int], max_tokens: int = 6) -> list[int]:
    address, decode_stub = decode[:2]
    response = prefill_stub.Prefill(engine_pb2.PrefillRequest(request_id=request_id, token_ids=ids,
                                                              decode_address=address), timeout=120)
    assert response.computed_tokens == len(ids)
    stream = decode_stub.Stream(engine_pb2.StreamRequest(
        request_id=request_id, sampling=inference_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)),
        timeout=120)
    return [t for r in stream for t in r.token_ids]


def free_slots(decode) -> int:
    return decode[1].Load(engine_pb2.LoadRequest()).free_slots


def test_dist_handoff_serves_the_same_greedy_tokens_as_grpc(decode, prefills, model):
    for i, n in enumerate((5, 700)):  # one prompt longer than a 512-token block
        ids = prompt(i, n)
        via_grpc = serve(prefills["grpc"], decode, f"grpc-{i}", ids)
        via_dist = serve(prefills["dist"], decode, f"dist-{i}", ids)
        expected = generate(model, ids, 6).token_ids
        assert via_dist == via_grpc == expected
    assert free_slots(decode) == 4


def test_dist_handoff_carries_the_key_ids_of_a_prompt_with_an_image(decode, prefills):
    # Decode keys its end-of-turn checkpoint by these ids, so that a prompt with an image is found again by
    # its image's content, whichever path the state took.
    address, decode_stub, service = decode
    ids = [40, 41, *[IMAGE_PLACEHOLDER_ID] * 4, 42, 43]
    digest = bytes(range(32))
    image = engine_pb2.VisualInput(start=2, content_hash=digest.hex(),
                                   embeddings=to_proto(torch.randn(4, 128, generator=torch.Generator().manual_seed(0))))
    expected = media_key_ids(ids, [(2, 4, digest)])
    assert expected != ids
    for path in ("grpc", "dist"):
        request_id = f"keys-{path}"
        prefills[path].Prefill(engine_pb2.PrefillRequest(request_id=request_id, token_ids=ids, images=[image],
                                                         decode_address=address), timeout=120)
        assert service.key_ids.pop(request_id) == expected, path
        assert decode_stub.CancelDecode(engine_pb2.CancelRequestById(request_id=request_id)).found
    assert free_slots(decode) == 4


DYING_PEER = """
import os, sys, time
import grpc, torch
from k3.model.presets import get_preset
from k3.model.state import SequenceState
from k3.protos.v1 import engine_pb2, engine_pb2_grpc
from k3.services.engine.handoff_dist import DistHandoffConfig, DistHandoffSender, pack, state_tensors

address = sys.argv[1]
cfg = get_preset("tiny")
state = SequenceState.fresh(cfg)
state.num_tokens = 3
sender = DistHandoffSender(DistHandoffConfig(backend="gloo", timeout_s=20), torch.device("cpu"))
stub = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(address))
peer = sender._peer(address, stub, time.monotonic() + 20)
_, specs = pack(state_tensors(state, torch.zeros(cfg.vocab_size), [1, 2, 3]), torch.device("cpu"))
call = stub.DistHandoff(engine_pb2.DistHandoffHeader(
    request_id="dies", group_key=peer.key, num_tokens=3, config_hash=state.config_hash, tensors=specs), timeout=60)
assert next(call).ready
print("ready", flush=True)
time.sleep(0.5)  # the decode worker is now waiting for the payload
os._exit(0)
"""


def test_a_peer_that_dies_mid_transfer_fails_only_its_request(decode, prefills, model):
    before = free_slots(decode)
    proc = subprocess.Popen([sys.executable, "-c", DYING_PEER, decode[0]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    _read_line(proc, "ready")
    proc.wait(timeout=30)
    # the dead peer's state was never parked, its slot never taken ...
    with pytest.raises(grpc.RpcError) as info:
        list(decode[1].Stream(engine_pb2.StreamRequest(request_id="dies"), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert free_slots(decode) == before
    # ... and the decode worker keeps taking dist hand-offs from live peers
    ids = prompt(7, 40)
    assert serve(prefills["dist"], decode, "after-death", ids) == generate(model, ids, 6).token_ids


def test_a_decode_worker_that_is_gone_fails_the_request_with_unavailable(decode, prefills):
    config = DecodeServiceConfig(
        server=ServerConfig(port=0, grace_seconds=0.5), model=SOURCE,
        engine=EngineConfig(max_batch=2, max_slots=2, page_size=16, num_pages=128, max_context=MAX_CONTEXT),
        decode=DecodeSettings(handoff="dist", dist=DistHandoffConfig(backend="gloo", timeout_s=20)))
    handle = start_server(DecodeService(config), config.server)
    doomed = (handle.address, engine_pb2_grpc.DecodeStub(grpc.insecure_channel(handle.address)))
    ids = prompt(8, 30)
    first = serve(prefills["dist"], doomed, "to-doomed", ids)  # the prefill worker now holds a pair group
    handle.stop(grace=0)
    with pytest.raises(grpc.RpcError) as info:
        prefills["dist"].Prefill(engine_pb2.PrefillRequest(request_id="to-gone", token_ids=ids,
                                                           decode_address=doomed[0]), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert serve(prefills["dist"], decode, "after-gone", ids) == first


def test_decode_refuses_dist_handoffs_when_not_configured_and_bad_headers(decode, model):
    config = DecodeServiceConfig(server=ServerConfig(port=0, grace_seconds=0.5), model=SOURCE,
                                 engine=EngineConfig(max_batch=1, max_slots=1, num_pages=16, page_size=16,
                                                                     max_context=256))
    handle = start_server(DecodeService(config), config.server)
    try:
        stub = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(handle.address))
        with pytest.raises(grpc.RpcError) as info:
            stub.DistConnect(engine_pb2.DistConnectRequest(backend="gloo"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_detail(info.value).reason == "DIST_HANDOFF_OFF"
    finally:
        handle.stop(grace=0)
    with pytest.raises(grpc.RpcError) as info:
        decode[1].DistConnect(engine_pb2.DistConnectRequest(backend="nccl"), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    header = engine_pb2.DistHandoffHeader(request_id="x", group_key="nobody", num_tokens=1, tensors=[
        engine_pb2.TensorSpec(name="layers.0.kda.state", dtype="float32", shape=[4]),
        engine_pb2.TensorSpec(name="last_logits", dtype="float32", shape=[model.cfg.vocab_size]),
        engine_pb2.TensorSpec(name="token_ids", dtype="int32", shape=[1])])
    with pytest.raises(grpc.RpcError) as info:
        list(decode[1].DistHandoff(header, timeout=10))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_detail(info.value).reason == "DIST_GROUP_UNKNOWN"
    header.tensors[0].dtype = "complex64"
    with pytest.raises(grpc.RpcError) as info:
        list(decode[1].DistHandoff(header, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(info.value).field == "tensors[0].dtype"


def test_payload_packs_aligned_and_round_trips():
    tensors = {"a": torch.arange(3, dtype=torch.int32), "b": torch.randn(2, 5, dtype=torch.bfloat16),
               "c": torch.randn(7, dtype=torch.float64), "empty": torch.zeros(0, 4)}
    buffer, specs = pack(tensors, torch.device("cpu"))
    offsets, total = payload_layout(specs)
    assert all(o % 64 == 0 for o in offsets) and buffer.numel() == total
    out = unpack(buffer, specs)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_header_validation_names_the_field():
    good = engine_pb2.DistHandoffHeader(request_id="r", group_key="g", num_tokens=1, tensors=[
        engine_pb2.TensorSpec(name="layers.0.kda.state", dtype="float32", shape=[2, 2]),
        engine_pb2.TensorSpec(name="last_logits", dtype="float32", shape=[10]),
        engine_pb2.TensorSpec(name="token_ids", dtype="int32", shape=[1])])
    assert validate_header(good, 10, 1 << 20) == 132  # 16 B at 0, 40 B at 64, 4 B at 128
    cases = [
        (dict(request_id=""), "request_id"), (dict(group_key=""), "group_key"), (dict(num_tokens=0), "num_tokens"),
        (dict(cached_tokens=-1), "cached_tokens"),
    ]
    for change, field in cases:
        bad = engine_pb2.DistHandoffHeader()
        bad.CopyFrom(good)
        for key, value in change.items():
            setattr(bad, key, value)
        with pytest.raises(Exception) as info:
            validate_header(bad, 10, 1 << 20)
        assert info.value.field == field
    bad = engine_pb2.DistHandoffHeader()
    bad.CopyFrom(good)
    bad.key_ids.extend([1, 2])  # one prompt token, two key ids
    with pytest.raises(Exception) as info:
        validate_header(bad, 10, 1 << 20)
    assert (info.value.field, info.value.reason) == ("key_ids", "BAD_KEY_IDS")
    bad = engine_pb2.DistHandoffHeader()
    bad.CopyFrom(good)
    bad.tensors[0].shape[0] = -1
    with pytest.raises(Exception) as info:
        validate_header(bad, 10, 1 << 20)
    assert info.value.field == "tensors[0].shape"
    with pytest.raises(Exception) as info:
        validate_header(good, 11, 1 << 20)
    assert info.value.reason == "BAD_LOGITS"
    with pytest.raises(Exception) as info:
        validate_header(good, 10, 8)
    assert info.value.reason == "BAD_STATE_SIZE"
    bad = engine_pb2.DistHandoffHeader()
    bad.CopyFrom(good)
    bad.tensors[2].shape[0] = 1 << 30  # a token list that does not match num_tokens is refused before any buffer
    with pytest.raises(Exception) as info:
        validate_header(bad, 10, 1 << 20)
    assert info.value.reason == "BAD_MANIFEST"


def test_handoff_mode_is_validated():
    with pytest.raises(ConfigError):
        PrefillSettings(handoff="nccl")
    with pytest.raises(ConfigError):
        DecodeSettings(handoff="")
    with pytest.raises(ConfigError):
        DistHandoffConfig(backend="mpi")
