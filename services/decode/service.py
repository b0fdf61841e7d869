"""The ``k3.v1.Decode`` service: KDA-aware continuous batching over handed-off prompt states.

- ``Handoff`` (client stream) reassembles a prefill worker's state (``engine.handoff``), parses it
  (safetensors, never pickle) and parks it in a free engine slot: RESOURCE_EXHAUSTED when no slot is free
  (checked on the first chunk already, so a full worker does not receive the whole state first), INVALID_ARGUMENT
  for malformed bytes, FAILED_PRECONDITION for a state of another model configuration. A parked state not
  claimed by a ``Stream`` within ``engine.parked_timeout_s`` is freed.
- ``Stream(request_id, sampling)`` joins the parked request to the running batch and streams one
  ``GenerateResponse`` per token (ids, text when a tokenizer is configured, the token's logprob and the requested
  top logprobs); the last one carries ``finish_reason`` and ``usage`` token counts (prices are the router's
  business). When the call ends early -- the client cancels, disconnects or its deadline passes -- the RPC's
  termination callback aborts the request in the engine, which frees its slot and pages at the next step.
- End of turn: the engine runs the last generated token through the model and hands over the final state
  (prompt + every generated token); it is stored in the cache store under the chained hash of exactly those
  tokens (``engine.checkpoints``), before the stream completes. The next turn's prompt (this prompt + the
  reply + a new message) then restores it at its message end in prefill, on any worker: a restarted decode
  worker loses nothing that was checkpointed. ``StreamRequest.message_ends`` is not needed for that -- prefill
  already checkpointed every message end of the prompt -- and is ignored.
- ``DistConnect`` / ``DistHandoff`` (with ``decode.handoff: dist``): the same hand-off with the tensors over a
  ``torch.distributed`` pair group and only the control over gRPC (``engine.handoff_dist``); without it they
  answer FAILED_PRECONDITION.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from k3.model.state import SequenceState
from k3.protos.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2
from k3.services.common.client import make_channel
from k3.services.common.errors import FailedPrecondition, InvalidArgument
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.decode.config import DecodeServiceConfig
from k3.services.engine.checkpoints import CheckpointStore
from k3.services.engine.engine import Engine
from k3.services.engine.errors import AlreadyExists, SlotsExhausted
from k3.services.engine.handoff import HandoffAssembler
from k3.services.engine.handoff_dist import DistHandoffHost, receive_handoff
from k3.services.engine.sampling import SamplingOptions
from k3.services.engine.stream import TokenEvent
from k3.services.registry import ServiceSpec

log = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def sampling_from_proto(params: inference_pb2.SamplingParams, stop_token_ids) -> SamplingOptions:
    """``SamplingParams`` + ``stop_token_ids`` as engine options (validated by the engine)."""
    return SamplingOptions(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_tokens,
        stop=tuple(params.stop), stop_token_ids=tuple(stop_token_ids),
        seed=params.seed if params.HasField("seed") else None, logprobs=params.logprobs,
    )


def event_to_proto(event: TokenEvent) -> inference_pb2.GenerateResponse:
    response = inference_pb2.GenerateResponse(request_id=event.request_id, text=event.text,
                                              finish_reason=event.finish_reason)
    if event.token_id is not None:
        response.token_ids.append(event.token_id)
        response.logprobs.append(event.logprob)
        response.top_logprobs.extend(inference_pb2.TokenLogprob(token_id=t, logprob=lp)
                                     for t, lp in event.top_logprobs)
    if event.usage is not None:
        response.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=event.usage.prompt_tokens, cached_prompt_tokens=event.usage.cached_prompt_tokens,
            completion_tokens=event.usage.completion_tokens))
    return response


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, service: DecodeService):
        self.service = service
        self.engine = service.engine

    def Handoff(self, request_iterator, context) -> engine_pb2.HandoffAck:
        assembler = HandoffAssembler(self.service.config.decode.max_state_bytes)
        for chunk in request_iterator:
            first = not assembler.request_id
            assembler.add(chunk)
            if first:  # refuse before the whole state has crossed the network
                if self.engine.stats().free_slots == 0:
                    raise SlotsExhausted(f"all {self.engine.config.max_slots} state slots are in use")
                if self.engine.is_parked(assembler.request_id):
                    raise AlreadyExists(f"a state for request {assembler.request_id!r} is already here",
                                        field="request_id")
        handoff = assembler.result(self.engine.cfg.vocab_size)
        try:
            state = SequenceState.from_bytes(handoff.state, device=self.engine.device)
        except Exception as exc:  # untrusted bytes: any parse failure is the sender's error
            raise InvalidArgument("state", f"is not a serialised SequenceState: {exc}", reason="BAD_STATE") from None
        slot = self.engine.load_state(handoff.request_id, state, handoff.last_logits, handoff.token_ids,
                                      cached_tokens=handoff.cached_tokens)
        self.service.key_ids.put(handoff.request_id, handoff.key_ids)
        return engine_pb2.HandoffAck(request_id=handoff.request_id, slot=slot)

    def Stream(self, request, context) -> Iterator[inference_pb2.GenerateResponse]:
        options = sampling_from_proto(request.sampling, request.stop_token_ids)
        checkpoint = _CheckpointJob(self.service, self.service.key_ids.pop(request.request_id))
        stream = self.engine.resume(request.request_id, options,
                                    on_final_state=checkpoint.submit if self.service.checkpoints else None)
        if not context.add_callback(stream.abort):  # the call already ended: nobody will read
            stream.abort()
        for event in stream:
            yield event_to_proto(event)
        checkpoint.wait()

    def DistConnect(self, request, context) -> engine_pb2.DistConnectResponse:
        return self._dist_host().connect(request)

    def DistHandoff(self, request, context) -> Iterator[engine_pb2.DistHandoffReply]:
        host = self._dist_host()
        if self.engine.stats().free_slots == 0:  # refuse before anything crosses the pair group
            raise SlotsExhausted(f"all {self.engine.config.max_slots} state slots are in use")
        if self.engine.is_parked(request.request_id):
            raise AlreadyExists(f"a state for request {request.request_id!r} is already here", field="request_id")

        def park(state, last_logits, token_ids, cached_tokens) -> int:
            slot = self.engine.load_state(request.request_id, state, last_logits, token_ids,
                                          cached_tokens=cached_tokens)
            self.service.key_ids.put(request.request_id, list(request.key_ids) or None)
            return slot

        yield from receive_handoff(host, request, context.is_active, context.time_remaining, park)

    def _dist_host(self) -> DistHandoffHost:
        if self.service.dist_host is None:
            raise FailedPrecondition("this decode worker takes hand-offs over gRPC only (decode.handoff: grpc)",
                                     field="decode.handoff", reason="DIST_HANDOFF_OFF")
        return self.service.dist_host

    def CancelDecode(self, request, context) -> engine_pb2.CancelResponse:
        self.service.key_ids.pop(request.request_id)
        return engine_pb2.CancelResponse(found=self.engine.abort(request.request_id))

    def Load(self, request, context) -> engine_pb2.LoadResponse:
        s = self.engine.stats()
        return engine_pb2.LoadResponse(running=s.running, queued=s.queued, tokens_processed=s.tokens_processed,
                                       free_slots=s.free_slots, aborted=s.aborted)


class _PromptKeys:
    """Cache-key ids of handed-off prompts with images, until their stream starts (bounded: a state that is
    never streamed must not keep its entry forever)."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, list[int]] = OrderedDict()

    def put(self, request_id: str, key_ids: list[int] | None) -> None:
        if key_ids is None:
            return
        with self._lock:
            self._keys[request_id] = key_ids
            while len(self._keys) > self.LIMIT:
                self._keys.popitem(last=False)

    def pop(self, request_id: str) -> list[int] | None:
        with self._lock:
            return self._keys.pop(request_id, None)


class _CheckpointJob:
    """The end-of-turn checkpoint of one stream: saved off the scheduler thread, awaited by the stream."""

    def __init__(self, service: DecodeService, key_ids: list[int] | None = None):
        self.service = service
        self.key_ids = key_ids
        self.future: Future | None = None
        self._lock = threading.Lock()

    def submit(self, state: SequenceState, token_ids: list[int], prompt_len: int) -> None:
        # MLA blocks up to the end of the prompt were stored by prefill; only later ones are new.
        # The saver thread runs it in the caller's context (the request's, see ``engine.tracing``), so the
        # cache store calls join the request's trace.
        run_in_context = contextvars.copy_context().run
        if self.key_ids is not None:  # a prompt with images: its cache keys hash the images' content
            token_ids = [*self.key_ids, *token_ids[prompt_len:]]
        with self._lock:
            self.future = self.service.saver.submit(run_in_context, self.service.checkpoints.save, token_ids,
                                                    state, prompt_len)

    def wait(self) -> None:
        with self._lock:
            future = self.future
        if future is not None:
            future.result()


class DecodeService:
    """``k3 serve decode``: owns the model, the engine, the cache store channel and the checkpoint saver."""

    name = "decode"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: DecodeServiceConfig, model=None, tokenizer=None,
                 telemetry: Telemetry | None = None, owns_telemetry: bool = False):
        self.config = config
        if model is None:
            model, tokenizer = config.model.load(server_config=config.server, telemetry=telemetry)
        self.telemetry = telemetry or Telemetry()
        self._owns_telemetry = owns_telemetry
        self.engine = Engine(model, config.engine, tokenizer=tokenizer, meter=self.telemetry.meter(),
                             tracer=self.telemetry.tracer() if self.telemetry.tracing else None)
        self._cache_channel = None
        self.checkpoints: CheckpointStore | None = None
        if config.cache_address and config.decode.checkpoint_on_finish:
            self._cache_channel = make_channel(config.cache_address, config.server, telemetry=telemetry)
            self.checkpoints = CheckpointStore(self._cache_channel, model.cfg, config.decode.cache_timeout_s,
                                               self.engine.device)
        self.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-decode-checkpoint")
        self.key_ids = _PromptKeys()
        self.dist_host = (DistHandoffHost(config.decode.dist, self.engine.device, model.cfg.vocab_size,
                                          config.decode.max_state_bytes)
                          if config.decode.handoff == "dist" else None)

    def add_to_server(self, server: grpc.Server) -> None:
        engine_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), server)

    def close(self) -> None:
        if self.dist_host is not None:
            self.dist_host.close()
        self.engine.close()
        self.saver.shutdown(wait=True)
        if self._cache_channel is not None:
            self._cache_channel.close()
        if self._owns_telemetry:
            self.telemetry.shutdown()


def build(config: DecodeServiceConfig) -> DecodeService:
    telemetry = setup_telemetry("decode", config.server)
    return DecodeService(config, telemetry=telemetry, owns_telemetry=True)


SPEC = ServiceSpec(config_type=DecodeServiceConfig, build=build)
