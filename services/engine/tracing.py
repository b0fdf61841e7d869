"""Trace context across the engine's scheduler thread.

A request enters the engine in a gRPC handler thread, where its server span is the current OpenTelemetry
context; the model runs later in the scheduler thread, where nothing is current. Calls the model makes from
there -- its MoE layers reaching expert pools, the end-of-turn checkpoint reaching the cache store -- would
start traces of their own. So the engine keeps each request's context (``capture`` when it is submitted or
resumed) and re-enters it around the work done for that request.

Design decisions:

- A batched step serves several requests at once, but a span has one parent. The step span is a child of the
  oldest request in the batch and *links* to the others, so every request's trace reaches the step (through
  the link) and the expert-pool calls made inside it have exactly one parent.
- Without a tracer (telemetry off, or tests) no span is made; the oldest request's context is still attached,
  so outgoing calls keep joining its trace through the caller's own tracing channel.
- Work for one request only (its final-state hand-over) runs in that request's own context (``attached``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind


def capture() -> Context:
    """The caller's current context (its active span), to re-enter in the scheduler thread."""
    return otel_context.get_current()


@contextmanager
def attached(context: Context | None) -> Iterator[None]:
    """Make ``context`` current for the block (nothing when it is None)."""
    if context is None:
        yield
        return
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def step_span(tracer: trace.Tracer | None, name: str, contexts: Sequence[Context | None],
              attributes: dict[str, int | str] | None = None) -> Iterator[None]:
    """A span for one scheduler step over requests with ``contexts`` (oldest first): child of the first
    request's span, linked to the others' (module docstring)."""
    parents = [c for c in contexts if c is not None]
    if not parents:
        yield
        return
    if tracer is None:
        with attached(parents[0]):
            yield
        return
    links = []
    for context in parents[1:]:
        span_context = trace.get_current_span(context).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    with tracer.start_as_current_span(name, context=parents[0], kind=SpanKind.INTERNAL, links=links,
                                      attributes=attributes or {}):
        yield
