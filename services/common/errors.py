"""Errors that handlers raise, and how they become gRPC statuses.

Design decisions:

- Handlers raise ``K3Error`` subclasses; they never call ``context.abort`` themselves. Each subclass fixes
  one ``grpc.StatusCode`` and a machine-readable ``reason``; ``field`` is the dotted path of the offending
  request field (``block.kind``) when there is one.
- The status carries a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer whose details hold a
  ``k3.v1.ErrorDetail``, so clients read the field and reason without parsing prose
  (``k3.services.common.client.error_detail``).
- Any other exception is a bug: the client gets INTERNAL with a short message, the traceback goes to the
  server log only (tracebacks leak internals and help nobody on the client side).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from k3.protos.v1 import common_pb2

INTERNAL_MESSAGE = "internal error (details are in the server log)"


class K3Error(Exception):
    """An error with a gRPC status. ``message`` is for humans, ``reason`` for programs."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: str = "UNKNOWN"

    def __init__(self, message: str, *, field: str = "", reason: str | None = None):
        self.message = message
        self.field = field
        if reason is not None:
            self.reason = reason
        super().__init__(f"{field}: {message}" if field else message)

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(field=self.field, reason=self.reason, message=self.message)


class InvalidArgument(K3Error):
    """A request field is malformed; ``field`` names it (``InvalidArgument("block.key", "must be 32 bytes")``)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str, *, reason: str | None = None):
        super().__init__(message, field=field, reason=reason)


class NotFound(K3Error):
    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class ResourceExhausted(K3Error):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class FailedPrecondition(K3Error):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class Unavailable(K3Error):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class DeadlineExceeded(K3Error):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class Unauthenticated(K3Error):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class Internal(K3Error):
    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


def to_status(error: K3Error) -> grpc.Status:
    """The rich status for ``error``: code, message and an ``ErrorDetail`` in the status details."""
    detail = any_pb2.Any()
    detail.Pack(error.detail())
    status = status_pb2.Status(code=error.code.value[0], message=str(error), details=[detail])
    return rpc_status.to_status(status)


def abort(context: grpc.ServicerContext, error: K3Error) -> None:
    """End the RPC with ``error``'s rich status (raises, like ``context.abort``)."""
    context.abort_with_status(to_status(error))
