"""Fixtures for the service tests: in-process servers on 127.0.0.1:0, stopped after each test."""

from __future__ import annotations

import pytest

from k3.services.common.config import ServerConfig
from k3.services.common.server import ServerHandle, start_server
from k3.services.common.telemetry import Telemetry


@pytest.fixture
def serve():
    """``serve(service, telemetry=None, **ServerConfig fields) -> ServerHandle`` on 127.0.0.1:0, stopped after."""
    handles: list[ServerHandle] = []

    def start(service, telemetry: Telemetry | None = None, **fields) -> ServerHandle:
        fields.setdefault("port", 0)
        fields.setdefault("grace_seconds", 1.0)
        handle = start_server(service, ServerConfig(**fields), telemetry=telemetry)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop(grace=0)
