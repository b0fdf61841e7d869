"""The ``k3.v1.Prefill`` service: restore the longest cached prefix, compute the rest, checkpoint, hand off.

For one ``Prefill`` call:

1. validate (non-empty prompt of valid ids shorter than ``max_context``, increasing ``message_ends``, a decode
   address) and wait for a free worker (``max_concurrent``; beyond ``max_queue`` waiting: RESOURCE_EXHAUSTED);
2. restore the longest cached prefix from the cache store (``CheckpointStore.restore``: KDA checkpoint of the
   last hit + the MLA blocks before it);
3. compute the uncached suffix with ``K3Model.prefill`` in pieces cut at every 512-token block boundary, every
   message end and every ``prefill_chunk`` tokens; after a piece that ends on a boundary or a message end the
   state is checkpointed (``blocks`` describes the keys, including partial blocks at message ends);
4. stream the state, the last token's logits and the prompt to ``decode_address`` with ``Decode.Handoff``.

Cancellation -- ``CancelPrefill(request_id)``, the caller cancelling, or its deadline -- is checked between
pieces, between cache calls and while the hand-off is in flight; the call then ends with CANCELLED (the
caller that went away never sees it) and counts in ``Load.aborted``.

With ``prefill.handoff: grpc`` (the default) the state moves as safetensors bytes in <= 1 MiB chunks; with
``dist`` its tensors cross a ``torch.distributed`` pair group (NCCL between GPUs, gloo on CPU) and gRPC carries
only the control (``engine.handoff_dist``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry.metrics import Observation

from k3.model.multimodal import slice_visual
from k3.protos.v1 import engine_pb2, engine_pb2_grpc
from k3.services.cache.hashing import BLOCK_TOKENS
from k3.services.common import metric_names as mn
from k3.services.common.client import make_channel
from k3.services.common.config import ServerConfig
from k3.services.common.errors import InvalidArgument, K3Error
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.engine.checkpoints import CheckpointStore
from k3.services.engine.errors import AlreadyExists, QueueFull, RequestCancelled
from k3.services.engine.handoff import MAX_REQUEST_ID_CHARS, handoff_chunks
from k3.services.engine.handoff_dist import DistHandoffSender
from k3.services.prefill.config import PrefillServiceConfig, PrefillSettings
from k3.services.prefill.images import PromptImages, prompt_images
from k3.services.registry import ServiceSpec

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
_POLL_S = 0.05


class HandoffFailed(K3Error):
    """The decode worker refused or did not take the state; carries the decode worker's status code."""

    reason = "HANDOFF_FAILED"

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message, field="decode_address")
        self.code = code


@dataclass
class _Job:
    request_id: str
    cancelled: threading.Event = field(default_factory=threading.Event)


class PrefillWorker:
    """Prompt processing without the gRPC layer (jobs, limits, counters); ``PrefillServicer`` wraps it."""

    def __init__(self, model, settings: PrefillSettings, checkpoints: CheckpointStore | None,
                 server_config: ServerConfig | None = None, telemetry: Telemetry | None = None):
        self.model = model
        self.cfg = model.cfg
        self.settings = settings
        self.checkpoints = checkpoints
        self.max_context = settings.max_context or model.cfg.max_seq_len
        if self.max_context > model.cfg.max_seq_len:
            raise ValueError(f"prefill.max_context {self.max_context} exceeds the model's max_seq_len "
                             f"{model.cfg.max_seq_len}")
        self.device = next(model.parameters()).device
        self._server_config = server_config or ServerConfig()
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self._workers = threading.Semaphore(settings.max_concurrent)
        self._jobs: dict[str, _Job] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._dist = DistHandoffSender(settings.dist, self.device) if settings.handoff == "dist" else None
        self.running = 0
        self.queued = 0
        self.tokens_processed = 0
        self.aborted = 0
        # The engine's catalogue metrics, for prompts: tokens run (phase "prompt"), queue length, running.
        meter = (telemetry or Telemetry()).meter()
        self._tokens = mn.ENGINE_TOKENS.instrument(meter)
        mn.ENGINE_QUEUED.instrument(meter, callbacks=[lambda options: [Observation(self.queued)]])
        mn.ENGINE_RUNNING.instrument(meter, callbacks=[lambda options: [Observation(self.running)]])

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
        if job is not None:
            job.cancelled.set()
        return job is not None

    def load(self) -> engine_pb2.LoadResponse:
        with self._lock:
            return engine_pb2.LoadResponse(
                running=self.running, queued=self.queued, tokens_processed=self.tokens_processed,
                free_slots=self.settings.max_concurrent - self.running, aborted=self.aborted)

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancelled.set()
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
        if self._dist is not None:
            self._dist.close()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = make_channel(address, self._server_config,
                                                                 telemetry=self._telemetry)
            return channel

    # -- validation -------------------------------------------------------------------------------------------
    def validate(self, request: engine_pb2.PrefillRequest) -> tuple[list[int], list[int]]:
        if not request.request_id:
            raise InvalidArgument("request_id", "is required", reason="MISSING_FIELD")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
        ids = list(request.token_ids)
        if not ids:
            raise InvalidArgument("token_ids", "must not be empty", reason="EMPTY_PROMPT")
        if len(ids) >= self.max_context:
            raise InvalidArgument("token_ids", f"{len(ids)} tokens leave no room to generate within max_context "
                                  f"{self.max_context}", reason="CONTEXT_TOO_LONG")
        vocab = self.cfg.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids[{bad}]", f"must be a token id in [0, {vocab}), got {ids[bad]}",
                                  reason="BAD_TOKEN_ID")
        ends = list(request.message_ends)
        for i, m in enumerate(ends):
            if not 1 <= m <= len(ids) or (i and m <= ends[i - 1]):
                raise InvalidArgument(f"message_ends[{i}]", f"must increase and lie in [1, {len(ids)}], got {m}",
                                      reason="BAD_MESSAGE_ENDS")
        if not request.decode_address:
            raise InvalidArgument("decode_address", "is required", reason="MISSING_FIELD")
        return ids, ends

    # -- one request ------------------------------------------------------------------------------------------
    def prefill(self, request: engine_pb2.PrefillRequest, is_active: Callable[[], bool],
                time_remaining: Callable[[], float | None]) -> engine_pb2.PrefillResponse:
        ids, ends = self.validate(request)
        images = prompt_images(request.images, ids, self.cfg.hidden_size, self.device, self.model.embed.weight.dtype)
        job = _Job(request.request_id)

        def check() -> None:
            if job.cancelled.is_set() or not is_active():
                raise RequestCancelled(f"prefill of request {job.request_id!r} was cancelled")

        with self._lock:
            if job.request_id in self._jobs:
                raise AlreadyExists(f"request {job.request_id!r} is already being prefilled", field="request_id")
            if self.running + self.queued >= self.settings.max_concurrent + self.settings.max_queue:
                raise QueueFull(f"{self.running} prompts running and {self.queued} waiting (max_queue)")
            self._jobs[job.request_id] = job
            self.queued += 1
        holding = False
        try:
            self._wait_for_worker(check)
            holding = True
            with self._lock:
                self.queued -= 1
                self.running += 1
            try:
                return self._run(request, ids, ends, check, time_remaining, images)
            finally:
                with self._lock:
                    self.running -= 1
        except RequestCancelled:
            with self._lock:
                self.aborted += 1
            raise
        finally:
            with self._lock:
                if not holding:
                    self.queued -= 1
                self._jobs.pop(job.request_id, None)
            if holding:
                self._workers.release()

    def _wait_for_worker(self, check: Callable[[], None]) -> None:
        while not self._workers.acquire(timeout=_POLL_S):
            check()

    def _run(self, request, ids: list[int], ends: list[int], check, time_remaining,
             images: PromptImages | None = None):
        # Images key the cache by their content (k3.services.vision.keys), so cache traffic uses key ids.
        keys = images.key_ids if images is not None else ids
        state = None
        if self.checkpoints is not None:
            state = self.checkpoints.restore(keys, ends, check)
        cached = state.num_tokens if state is not None else 0
        pos, logits, stored = cached, None, 0
        cuts = sorted({*range(BLOCK_TOKENS, len(ids) + 1, BLOCK_TOKENS), *ends, len(ids)})
        message_ends = set(ends)
        while pos < len(ids):
            check()
            end = min(next(c for c in cuts if c > pos), pos + self.settings.prefill_chunk)
            visual = slice_visual(images.visual, pos, end) if images is not None else None
            out, state = self.model.prefill(torch.tensor(ids[pos:end], dtype=torch.long, device=self.device), state,
                                            visual)
            logits = out[-1]
            with self._lock:
                self.tokens_processed += end - pos
            self._tokens.add(end - pos, {"phase": "prompt"})
            if self.checkpoints is not None and (end % BLOCK_TOKENS == 0 or end in message_ends):
                check()
                stored += self.checkpoints.save(keys, state, mla_from=pos)
            pos = end
        check()
        self._hand_off(request.request_id, request.decode_address, state, logits, ids, cached, check,
                       time_remaining, keys if images is not None else None)
        return engine_pb2.PrefillResponse(request_id=request.request_id, prompt_tokens=len(ids),
                                          cached_tokens=cached, computed_tokens=len(ids) - cached,
                                          checkpoints_stored=stored)

    def _hand_off(self, request_id: str, address: str, state, logits, ids: Sequence[int], cached: int,
                  check: Callable[[], None], time_remaining: Callable[[], float | None],
                  key_ids: Sequence[int] | None = None) -> None:
        remaining = time_remaining()
        timeout = self.settings.handoff_timeout_s if remaining is None else min(remaining,
                                                                                self.settings.handoff_timeout_s)
        if self._dist is not None:
            self._hand_off_dist(request_id, address, state, logits, ids, cached, check, timeout, key_ids)
            return
        chunks = handoff_chunks(request_id, state.to_bytes(), logits, ids, cached,
                                self.settings.handoff_chunk_bytes, key_ids=key_ids)
        stub = engine_pb2_grpc.DecodeStub(self._channel(address))
        future = stub.Handoff.future(chunks, timeout=timeout)
        while True:
            try:
                future.result(timeout=_POLL_S)
                return
            except grpc.FutureTimeoutError:
                try:
                    check()
                except RequestCancelled:
                    future.cancel()
                    raise
            except grpc.RpcError as exc:
                check()  # our own deadline or cancellation: report that, not the hand-off's symptom
                raise HandoffFailed(exc.code(), f"decode worker {address} did not take the state: "
                                    f"{exc.code().name}: {exc.details()}") from None


    def _hand_off_dist(self, request_id: str, address: str, state, logits, ids: Sequence[int], cached: int,
                       check: Callable[[], None], timeout: float, key_ids: Sequence[int] | None) -> None:
        def cancelled() -> bool:
            try:
                check()
                return False
            except RequestCancelled:
                return True

        try:
            self._dist.hand_off(address, self._channel(address), request_id, state, logits, ids, cached, timeout,
                                cancelled, key_ids)
        except K3Error:
            check()  # our own deadline or cancellation: report that, not the hand-off's symptom
            raise


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    def Prefill(self, request, context):
        return self.worker.prefill(request, context.is_active, context.time_remaining)

    def CancelPrefill(self, request, context):
        return engine_pb2.CancelResponse(found=self.worker.cancel(request.request_id))

    def Load(self, request, context):
        return self.worker.load()


class PrefillService:
    """``k3 serve prefill``: owns the model, the cache store channel and the worker."""

    name = "prefill"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: PrefillServiceConfig, model=None, telemetry: Telemetry | None = None,
                 owns_telemetry: bool = False):
        # The server shares these providers (``start_server`` takes ``service.telemetry``): the spans of the
        # calls to the cache store, the decode worker and the expert pools join the Prefill call's trace.
        # None: the server builds providers from its config; the worker's metrics and spans are then not recorded.
        self.telemetry = telemetry
        self._owns_telemetry = owns_telemetry
        if model is None:
            model, _ = config.model.load(server_config=config.server, telemetry=telemetry)
        self.model = model
        self._cache_channel = (make_channel(config.cache_address, config.server, telemetry=telemetry)
                               if config.cache_address else None)
        checkpoints = (CheckpointStore(self._cache_channel, model.cfg, config.prefill.cache_timeout_s,
                                       next(model.parameters()).device)
                       if self._cache_channel is not None else None)
        self.worker = PrefillWorker(model, config.prefill, checkpoints, config.server, telemetry)

    def add_to_server(self, server: grpc.Server) -> None:
        engine_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self.worker), server)

    def close(self) -> None:
        self.worker.close()
        if self._cache_channel is not None:
            self._cache_channel.close()
        if self._owns_telemetry and self.telemetry is not None:
            self.telemetry.shutdown()


def build(config: PrefillServiceConfig) -> PrefillService:
    telemetry = setup_telemetry("prefill", config.server)
    try:
        return PrefillService(config, telemetry=telemetry, owns_telemetry=True)
    except BaseException:
        telemetry.shutdown()  # a model that fails to load must not leave the metrics port bound
        raise


SPEC = ServiceSpec(config_type=PrefillServiceConfig, build=build)
