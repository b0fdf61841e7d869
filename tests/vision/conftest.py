"""Fixtures for the vision tests: in-process gRPC servers on 127.0.0.1:0, stopped after each test."""

from __future__ import annotations

import pytest

from k3.services.common.config import ServerConfig
from k3.services.common.server import ServerHandle, start_server


@pytest.fixture
def serve():
    """``serve(service, **ServerConfig fields) -> ServerHandle`` on 127.0.0.1:0, stopped after the test."""
    handles: list[ServerHandle] = []

    def start(service, **fields) -> ServerHandle:
        fields.setdefault("port", 0)
        fields.setdefault("grace_seconds", 1.0)
        fields.setdefault("tracing", False)
        fields.setdefault("metrics", False)
        handle = start_server(service, ServerConfig(**fields))
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop(grace=0)
