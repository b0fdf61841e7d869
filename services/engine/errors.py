"""Errors of the engine and of the services around it, each with its gRPC status.

They subclass ``k3.services.common.errors.K3Error``, so a gRPC handler can let them propagate (the error
interceptor turns them into rich statuses) and an in-process user (an RL rollout worker) can catch them by
class. ``reason`` strings are stable and machine-readable.
"""

from __future__ import annotations

import grpc

from k3.services.common.errors import K3Error, NotFound, ResourceExhausted, Unavailable


class SlotsExhausted(ResourceExhausted):
    """Every state slot is taken (and, for requests that may wait, the queue is full too)."""

    reason = "SLOTS_EXHAUSTED"


class PagesExhausted(ResourceExhausted):
    """The MLA page pool cannot hold the request, now or ever."""

    reason = "PAGES_EXHAUSTED"


class QueueFull(ResourceExhausted):
    """The waiting queue is at its limit."""

    reason = "QUEUE_FULL"


class UnknownRequest(NotFound):
    """No request (or handed-off state) with this id."""

    reason = "UNKNOWN_REQUEST"


class AlreadyExists(K3Error):
    """A request with this id is already in flight."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


class RequestCancelled(K3Error):
    """The request was cancelled (by id, by the caller going away, or by its deadline) and its work stopped."""

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class EngineClosed(Unavailable):
    """The engine was closed, or its scheduler died; no request can run on it any more."""

    reason = "ENGINE_CLOSED"


class ComputeUnavailable(Unavailable):
    """A step of this request needed a part of the model computed elsewhere (its routed experts, on expert pools)
    and no replica could serve it in time. Only the requests of that step fail; the engine keeps serving."""

    reason = "COMPUTE_UNAVAILABLE"
