"""One way to run any k3 gRPC service: interceptors, limits, health, reflection, graceful shutdown.

``start_server(service, config)`` starts serving in background threads and returns a ``ServerHandle`` (the
bound port included, so tests use port 0). ``run_server`` is the process entry point: it serves until
SIGTERM/SIGINT, then shuts down gracefully.

Design decisions:

- A ``Service`` is anything that can add its servicers to a ``grpc.Server``, names its full gRPC service
  names (for health and reflection) and can be closed. The server owns the service once started: stopping
  the server closes it, after the last in-flight RPC.
- Shutdown order: health says NOT_SERVING (load balancers stop routing), the server stops accepting new RPCs
  (they fail with UNAVAILABLE), in-flight RPCs and streams get ``grace_seconds`` to finish and are then
  cancelled, and only then is the service closed. A handler that ignores the cancellation past the grace
  period is the one case that can still touch the closed service; its client has already been answered.
- ``grpc.so_reuseport`` is off: a second server on the same port must fail to start, not silently share it.
- Client deadlines are honoured by gRPC and the error interceptor (see ``interceptors``); handlers read
  ``context.time_remaining()`` for long work.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Protocol, runtime_checkable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from k3.services.common.client import channel_options
from k3.services.common.config import ServerConfig, format_address
from k3.services.common.interceptors import (
    AuthInterceptor,
    ErrorInterceptor,
    InFlightInterceptor,
    TelemetryInterceptor,
)
from k3.services.common.telemetry import Telemetry, setup_telemetry

log = logging.getLogger(__name__)


@runtime_checkable
class Service(Protocol):
    """What the bootstrap needs from a service."""

    #: short name, as in ``k3 serve <name>`` (also the telemetry service name)
    name: str
    #: full gRPC service names it serves, e.g. ``["k3.v1.CacheStore"]``
    service_names: Sequence[str]

    def add_to_server(self, server: grpc.Server) -> None:
        """Register the servicers (``add_XServicer_to_server`` or generic handlers)."""

    def close(self) -> None:
        """Release resources; called once, after the server stopped and in-flight RPCs ended."""


class BindError(RuntimeError):
    """The server could not listen on the configured address."""


class ServerHandle:
    """A started server. ``stop()`` is graceful and idempotent; ``wait()`` blocks until it has stopped."""

    def __init__(self, server: grpc.Server, executor: futures.ThreadPoolExecutor, port: int,
                 health_servicer: health.HealthServicer, in_flight: InFlightInterceptor, service: Service,
                 config: ServerConfig, telemetry: Telemetry, owns_telemetry: bool):
        self.server = server
        self._executor = executor
        self.port = port
        self.service = service
        self.config = config
        self.telemetry = telemetry
        self._health = health_servicer
        self._in_flight = in_flight
        self._owns_telemetry = owns_telemetry
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._stopping = False

    @property
    def in_flight(self) -> int:
        """RPCs being handled right now (streams until their last message)."""
        return self._in_flight.count

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, refuse new RPCs, drain in-flight ones for ``grace`` seconds, close the service."""
        with self._lock:
            if self._stopping:
                first = False
            else:
                self._stopping = first = True
        if not first:
            self._stopped.wait()
            return
        grace = self.config.grace_seconds if grace is None else grace
        try:
            self._health.enter_graceful_shutdown()
            log.info("stopping %s: draining %d in-flight RPC(s) for up to %gs",
                     self.service.name, self.in_flight, grace)
            self.server.stop(grace).wait()
            self._executor.shutdown(wait=False, cancel_futures=True)  # release the idle worker threads
        finally:
            try:
                self.service.close()
            finally:
                if self._owns_telemetry:
                    self.telemetry.shutdown()
                self._stopped.set()
                log.info("%s stopped", self.service.name)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until ``stop()`` has finished; False if ``timeout`` passed first."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def build_server(
    config: ServerConfig, telemetry: Telemetry, in_flight: InFlightInterceptor, executor: futures.Executor
) -> grpc.Server:
    """A ``grpc.Server`` with k3's interceptors and message limits on ``executor`` (not yet bound or started)."""
    interceptors: list[grpc.ServerInterceptor] = [in_flight]
    if telemetry.tracing or telemetry.metrics:
        interceptors.append(TelemetryInterceptor(telemetry))
    if config.auth_token:
        interceptors.append(AuthInterceptor(config.auth_token))
    interceptors.append(ErrorInterceptor())
    options = [*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)]
    return grpc.server(executor, interceptors=interceptors, options=options)


def start_server(service: Service, config: ServerConfig, *, telemetry: Telemetry | None = None) -> ServerHandle:
    """Serve ``service`` on ``config.host:config.port`` in background threads; returns once it is SERVING.

    Without ``telemetry``, the service's own ``telemetry`` attribute is used when it has one, else providers
    are built from ``config`` (and shut down with the server). On failure the service is closed before the
    error propagates.
    """
    if telemetry is None and isinstance(getattr(service, "telemetry", None), Telemetry):
        # A service that built its own providers (to record its own metrics) shares them with the server:
        # one meter provider, one metrics endpoint per process. The service shuts them down in close().
        telemetry = service.telemetry
    owns_telemetry = telemetry is None
    if telemetry is None:
        try:
            telemetry = setup_telemetry(service.name, config)
        except OSError as exc:  # the metrics port (server.metrics_port) is taken: a bind failure like gRPC's
            service.close()
            raise BindError(str(exc)) from None
    executor = futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="k3-rpc")
    try:
        in_flight = InFlightInterceptor()
        server = build_server(config, telemetry, in_flight, executor)
        service.add_to_server(server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = list(service.service_names)
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        try:
            port = server.add_insecure_port(config.address)
        except RuntimeError as exc:  # grpc raises when the address cannot be bound
            raise BindError(f"cannot listen on {config.address}: {exc}") from None
        if port == 0:
            raise BindError(f"cannot listen on {config.address}")
        server.start()
    except BaseException:
        executor.shutdown(wait=False)
        try:
            service.close()
        finally:
            if owns_telemetry:
                telemetry.shutdown()
        raise
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving %s on %s", service.name, ", ".join(names), format_address(config.host, port))
    if telemetry.metrics_endpoint is not None:
        log.info("%s metrics at %s", service.name, telemetry.metrics_endpoint.url)
    return ServerHandle(
        server, executor, port, health_servicer, in_flight, service, config, telemetry, owns_telemetry
    )


def run_server(
    service: Service,
    config: ServerConfig,
    *,
    on_started: Callable[[ServerHandle], None] | None = None,
    telemetry: Telemetry | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT, then stop gracefully; returns the process exit status (0).

    Must be called from the main thread (signal handlers). ``on_started`` runs once the server is SERVING,
    e.g. to print the bound port.
    """
    stop_requested = threading.Event()

    def request_stop(signum, frame):  # runs in the main thread, between bytecodes: only set a flag
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop_requested.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        handle = start_server(service, config, telemetry=telemetry)
        try:
            if on_started is not None:
                on_started(handle)
            # A timeout keeps the wait interruptible on every platform; the loop costs nothing.
            while not stop_requested.wait(timeout=1.0):
                pass
        finally:
            handle.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
