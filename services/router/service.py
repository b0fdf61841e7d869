"""``k3 serve router``: the ``k3.v1.Inference`` servicer (Generate, Chat, Abort) over the ``Pipeline``.

Design decisions:

- Validation first, then registration: a malformed request is refused before it gets a request id slot,
  admission budget or worker. Every refusal is a ``K3Error`` with the proto field it is about.
- Generate: text is tokenised as data (``encode_text``: typed reserved literals stay text) unless token ids
  are given; it stops at ``<|eos|>``. The whole prompt is one "message" (its end is a checkpoint), so a
  later request continuing the same ids restores it. Chat: messages are rendered as XTML
  (``k3.services.router.chat``); it stops at ``<|end_of_msg|>`` (or ``<|eos|>``), and its finish reason is
  ``tool_calls`` when the answer called tools and ended normally.
- Images (Chat image parts, Generate ``images`` with one placeholder id each in ``prompt_token_ids``) are
  encoded by the vision service and expanded into the prompt before admission
  (``k3.services.router.images``); the prompt limits apply to the expanded prompt.
- The gRPC done-callback of each call is what notices a client that went away or a deadline that passed;
  it cancels the request's downstream work (``Pipeline.cancel``).
- The router has its own ``Telemetry`` (from the same ``server`` settings as the gRPC server's): its meter
  carries the usage and cost counters and its tracer the client spans of the calls to the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import grpc

from k3.protos.v1 import cache_pb2_grpc, engine_pb2_grpc, inference_pb2, inference_pb2_grpc
from k3.services.common.client import make_channel
from k3.services.common.errors import InvalidArgument
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.registry import ServiceSpec
from k3.services.router import validation
from k3.services.router.admission import Admission
from k3.services.router.chat import ChatOutput, build_prompt
from k3.services.router.config import ModelInfo, RouterServiceConfig, resolve_model
from k3.services.router.images import ImageInput, ImageResolver, check_placeholders, no_vision
from k3.services.router.latency import LatencyRecorder
from k3.services.router.pipeline import CLIENT_GONE, DEADLINE, Event, Finished, InFlight, Job, Pipeline
from k3.services.router.routing import PrefixIndex, Router, Worker, WorkerPool
from k3.services.router.usage import UsageTotals

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
GENERATE_STOP = ("<|eos|>",)
CHAT_STOP = ("<|end_of_msg|>", "<|eos|>")
# gRPC reports "no deadline" as a deadline far in the future.
NO_DEADLINE_SECONDS = 1e8


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, config: RouterServiceConfig, model: ModelInfo, pipeline: Pipeline,
                 images: ImageResolver | None = None):
        self._config = config
        self._images = images
        self._limits = config.limits
        self._model = model
        self._pipeline = pipeline
        tokenizer = model.tokenizer
        self._generate_stop = [tokenizer.special_id(name) for name in GENERATE_STOP]
        self._chat_stop = [tokenizer.special_id(name) for name in CHAT_STOP]

    # -- Generate ------------------------------------------------------------------------------------------------
    def Generate(self, request: inference_pb2.GenerateRequest, context) -> Iterator[inference_pb2.GenerateResponse]:
        limits = self._limits
        validation.check_request_id(request.request_id, limits)
        validation.check_sampling(request.sampling, limits)
        if request.prompt_token_ids:
            if request.prompt:
                raise InvalidArgument("prompt", "give prompt or prompt_token_ids, not both", reason="AMBIGUOUS")
            field = "prompt_token_ids"
            if len(request.prompt_token_ids) > limits.max_prompt_tokens:
                raise InvalidArgument(field, f"has {len(request.prompt_token_ids)} tokens, more than the limit of "
                                      f"{limits.max_prompt_tokens}", reason="PROMPT_TOO_LARGE")
            ids = list(request.prompt_token_ids)
            validation.check_token_ids(ids, self._model.vocab_size, field)
        else:
            field = "prompt"
            validation.check_prompt_text(request.prompt, limits, field)
            ids = self._model.tokenizer.encode_text(request.prompt)
        images = [ImageInput(ref, f"images[{i}]") for i, ref in enumerate(request.images)]
        job = self._with_images(Job("generate", request.request_id, ids, [len(ids)], request.sampling,
                                    self._generate_stop, field), images, context)
        job.sampling = self._sampling(request.sampling, len(job.token_ids), field)

        def convert(event: Event, request_id: str) -> Iterator[inference_pb2.GenerateResponse]:
            if isinstance(event, Finished):
                response = inference_pb2.GenerateResponse()
                if event.last is not None:
                    response.CopyFrom(event.last)
                response.finish_reason = event.finish_reason
                response.usage.CopyFrom(event.usage)
            else:
                response = event.response
            response.request_id = request_id
            yield response

        yield from self._serve(job, context, convert)

    # -- Chat ------------------------------------------------------------------------------------------------------
    def Chat(self, request: inference_pb2.ChatRequest, context) -> Iterator[inference_pb2.ChatResponse]:
        validation.check_request_id(request.request_id, self._limits)
        validation.check_sampling(request.sampling, self._limits)
        prompt = build_prompt(request, self._model.tokenizer, self._limits)
        job = self._with_images(Job("chat", request.request_id, prompt.token_ids, prompt.message_ends,
                                    request.sampling, self._chat_stop, "messages"), prompt.images, context)
        job.sampling = self._sampling(request.sampling, len(job.token_ids), "messages")
        output = ChatOutput(self._model.tokenizer, prompt.thinking)

        def convert(event: Event, request_id: str) -> Iterator[inference_pb2.ChatResponse]:
            if not isinstance(event, Finished):
                deltas = output.feed(list(event.response.token_ids))
                if not deltas.empty():
                    yield deltas.to_response(request_id)
                return
            deltas = output.feed(list(event.last.token_ids)) if event.last is not None else None
            final = output.end()
            if deltas is not None:
                deltas.think += final.think
                deltas.response += final.response
                for delta in final.tool_calls:
                    deltas.add_tool(delta.index, delta.name, delta.arguments_delta)
            else:
                deltas = final
            response = deltas.to_response(request_id)
            reason = event.finish_reason
            response.finish_reason = "tool_calls" if reason == "stop" and output.tool_calls else reason
            response.usage.CopyFrom(event.usage)
            yield response

        yield from self._serve(job, context, convert)

    # -- Abort -----------------------------------------------------------------------------------------------------
    def Abort(self, request: inference_pb2.AbortRequest, context) -> inference_pb2.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "must not be empty", reason="EMPTY")
        return inference_pb2.AbortResponse(found=self._pipeline.abort(request.request_id))

    # -- shared ----------------------------------------------------------------------------------------------------
    def _with_images(self, job: Job, images: list[ImageInput], context) -> Job:
        """``job`` with its images encoded and expanded into the prompt (``images`` module); a prompt with
        placeholder ids needs as many images."""
        if not images:
            check_placeholders(job.token_ids, images, job.prompt_field)
            return job
        if self._images is None:
            raise no_vision(images)
        check_placeholders(job.token_ids, images, job.prompt_field)
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None and remaining < NO_DEADLINE_SECONDS else None
        resolved = self._images.resolve(job.token_ids, images, job.prompt_field, timeout)
        limit = self._limits.max_prompt_tokens
        if len(resolved.token_ids) > limit:
            raise InvalidArgument(job.prompt_field, f"has {len(resolved.token_ids)} tokens with its images' visual "
                                  f"tokens, more than the limit of {limit}", reason="PROMPT_TOO_LARGE")
        job.token_ids, job.key_ids, job.images = resolved.token_ids, resolved.key_ids, resolved.images
        job.message_ends = [resolved.shift(end) for end in job.message_ends]
        return job

    def _sampling(self, sampling: inference_pb2.SamplingParams, prompt_tokens: int,
                  prompt_field: str) -> inference_pb2.SamplingParams:
        resolved = inference_pb2.SamplingParams()
        resolved.CopyFrom(sampling)
        resolved.max_tokens = validation.resolve_max_tokens(
            prompt_tokens, sampling.max_tokens, self._model.max_context, self._limits, prompt_field
        )
        return resolved

    def _serve(self, job: Job, context, convert: Callable[[Event, str], Iterator]) -> Iterator:
        flight = self._pipeline.register(job.request_id)
        job.request_id = flight.request_id
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None and remaining < NO_DEADLINE_SECONDS else None

        def on_rpc_done() -> None:
            if flight.phase != "done":
                passed = deadline is not None and time.monotonic() >= deadline
                self._pipeline.cancel(flight, DEADLINE if passed else CLIENT_GONE)

        try:
            if not context.add_callback(on_rpc_done):
                return  # the RPC already ended (cancelled before we started)
            for event in self._pipeline.run(job, flight, deadline):
                yield from convert(event, flight.request_id)
        finally:
            self._pipeline.unregister(flight)


class RouterService:
    """The router as a ``Service`` for ``k3.services.common.server``."""

    name = "router"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: RouterServiceConfig, model: ModelInfo, telemetry: Telemetry | None = None):
        self.config = config
        self.model = model
        self._owns_telemetry = telemetry is None
        self.telemetry = telemetry or setup_telemetry(self.name, config.server)
        up = config.upstream
        self._channels: dict[str, grpc.Channel] = {}
        prefill = [Worker(i, a, engine_pb2_grpc.PrefillStub(self._channel(a))) for i, a in enumerate(up.prefill)]
        decode = [Worker(i, a, engine_pb2_grpc.DecodeStub(self._channel(a))) for i, a in enumerate(up.decode)]
        stores = {a: cache_pb2_grpc.CacheStoreStub(self._channel(a)) for a in up.cache}
        pools = [
            WorkerPool(kind, workers, up.load_refresh_seconds, up.probe_timeout_seconds, up.retry_unavailable_seconds)
            for kind, workers in (("prefill", prefill), ("decode", decode))
        ]
        index = PrefixIndex(stores, [up.cache_for(i) for i in range(len(prefill))], up.probe_timeout_seconds)
        self.router = Router(pools[0], pools[1], index, config.routing.affinity_weight)
        self.admission = Admission(config.admission)
        meter = self.telemetry.meter() if self.telemetry.metrics else None
        self.totals = UsageTotals(config.prices, meter)
        self.pipeline = Pipeline(self.router, self.admission, config.prices, self.totals, up.probe_timeout_seconds,
                                 LatencyRecorder(meter))
        self.images = (ImageResolver(up.vision, self._channel(up.vision), up.vision_timeout_seconds)
                       if up.vision is not None else None)

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = make_channel(address, self.config.server, telemetry=self.telemetry)
        return self._channels[address]

    def in_flight(self) -> list[InFlight]:
        return self.pipeline.in_flight()

    def add_to_server(self, server: grpc.Server) -> None:
        servicer = InferenceServicer(self.config, self.model, self.pipeline, self.images)
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)

    def close(self) -> None:
        totals = self.totals.snapshot()
        log.info("router totals: %d requests, %d prompt tokens (%d cached), %d generated, cost $%.6f "
                 "(saved $%.6f)", totals.requests, totals.prompt_tokens, totals.cached_prompt_tokens,
                 totals.completion_tokens, totals.cost_usd, totals.saved_usd)
        for channel in self._channels.values():
            channel.close()
        if self._owns_telemetry:
            self.telemetry.shutdown()


def build(config: RouterServiceConfig) -> RouterService:
    return RouterService(config, resolve_model(config.model))


SPEC = ServiceSpec(config_type=RouterServiceConfig, build=build)
