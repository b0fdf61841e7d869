"""A serving cluster for the router tests: cache store, prefill, decode and router servers on loopback.

Every service is a real gRPC server on 127.0.0.1 (port 0) in this process; the prefill and decode workers
share one ``tiny`` model (seed 0) so the tests can compare served tokens with ``generate()`` on it.
A plainly named module (not ``conftest``) so that test files import it explicitly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from k3.model.presets import get_preset
from k3.model.tokenizer import ByteTokenizer
from k3.model.transformer import K3Model
from k3.protos.v1 import engine_pb2, engine_pb2_grpc, inference_pb2_grpc
from k3.services.cache.service import CacheServiceConfig
from k3.services.cache.service import build as build_cache
from k3.services.common.config import ServerConfig
from k3.services.common.server import ServerHandle, start_server
from k3.services.decode.config import DecodeServiceConfig
from k3.services.decode.service import DecodeService
from k3.services.engine.config import EngineConfig
from k3.services.prefill.config import PrefillServiceConfig, PrefillSettings
from k3.services.prefill.service import PrefillService
from k3.services.router.config import AdmissionConfig, ModelInfo, RouterServiceConfig, UpstreamConfig
from k3.services.router.service import RouterService

PRESET = "tiny"
SEED = 0
MAX_CONTEXT = 4096


def tiny_model() -> K3Model:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = K3Model(get_preset(PRESET))
    return model.eval()


def _server(**fields) -> ServerConfig:
    return ServerConfig(port=0, grace_seconds=0.5, max_workers=96, metrics=False, tracing=False, **fields)


@dataclass
class Cluster:
    model: K3Model
    tokenizer: ByteTokenizer
    cache: ServerHandle
    prefill: ServerHandle
    decode: ServerHandle
    routers: list[ServerHandle] = field(default_factory=list)

    def start_router(self, admission: AdmissionConfig | None = None, max_context: int = MAX_CONTEXT,
                     **limits) -> ServerHandle:
        config = RouterServiceConfig(
            server=_server(),
            upstream=UpstreamConfig(prefill=[self.prefill.address], decode=[self.decode.address],
                                    cache=[self.cache.address]),
            admission=admission or AdmissionConfig(),
        )
        for name, value in limits.items():
            setattr(config.limits, name, value)
        info = ModelInfo(tokenizer=self.tokenizer, max_context=max_context, vocab_size=self.model.cfg.vocab_size)
        handle = start_server(RouterService(config, info), config.server)
        self.routers.append(handle)
        return handle

    def stop(self) -> None:
        for handle in [*self.routers, self.prefill, self.decode, self.cache]:
            handle.stop(grace=0)


def start_cluster(prefill_chunk: int = 128) -> Cluster:
    model = tiny_model()
    tokenizer = ByteTokenizer()
    cache_config = CacheServiceConfig(server=_server())
    cache = start_server(build_cache(cache_config), cache_config.server)
    prefill_config = PrefillServiceConfig(
        server=_server(), cache_address=cache.address,
        prefill=PrefillSettings(prefill_chunk=prefill_chunk, max_queue=64),
    )
    prefill = start_server(PrefillService(prefill_config, model=model), prefill_config.server)
    decode_config = DecodeServiceConfig(
        server=_server(), cache_address=cache.address,
        engine=EngineConfig(max_batch=16, max_slots=32, max_context=MAX_CONTEXT, num_pages=4096, max_queue=64),
    )
    decode = start_server(DecodeService(decode_config, model=model, tokenizer=tokenizer), decode_config.server)
    return Cluster(model, tokenizer, cache, prefill, decode)


def inference_stub(handle: ServerHandle) -> tuple[grpc.Channel, inference_pb2_grpc.InferenceStub]:
    channel = grpc.insecure_channel(handle.address)
    return channel, inference_pb2_grpc.InferenceStub(channel)


def load(handle: ServerHandle, kind: str) -> engine_pb2.LoadResponse:
    with grpc.insecure_channel(handle.address) as channel:
        stub = engine_pb2_grpc.PrefillStub(channel) if kind == "prefill" else engine_pb2_grpc.DecodeStub(channel)
        return stub.Load(engine_pb2.LoadRequest(), timeout=10)


def wait_for(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``condition`` until true; fail after ``timeout`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
