"""The prefill -> decode hand-off over ``torch.distributed``: gRPC carries the control, a pair group the tensors.

Used when ``handoff: dist`` is set on both workers (``grpc`` stays the default: the safetensors byte stream of
``engine.handoff``). NCCL between GPUs, gloo on CPU, same code.

Rendezvous (decode hosts, prefill joins):

- A decode worker with ``handoff: dist`` runs a ``TCPStore`` server (``dist.store_port``, 0 = a free port).
- A prefill worker's first dist hand-off to a decode address calls ``Decode.DistConnect``; the decode worker
  names a new *pair group* (a fresh ``group_key``) and answers with the key and the store's port. Both sides
  then build a two-rank process group (prefill rank 0, decode rank 1) over ``PrefixStore(group_key, store)``
  -- the decode side on a background thread -- and exchange a one-element all-reduce, so a pair is known to
  work before it carries a state. The prefill worker reaches the store at the host of the decode address.
- Process groups are built as standalone backend objects (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never
  the process-wide default group: a decode worker holds one per prefill peer (at most ``dist.max_peers``; the
  least recently used idle one is dropped beyond that), and a prefill worker one per decode address.

One hand-off (``Decode.DistHandoff``, server-streaming):

1. prefill sends the header: request id, group key, ``num_tokens``, ``config_hash``, cached tokens, and the
   manifest (name, dtype, shape) of the payload: the ``SequenceState.tensors()``, ``last_logits`` and
   ``token_ids``, packed in that order into one flat byte buffer at 64-byte aligned offsets (one send
   instead of dozens; the packing copy runs at device-memory speed, well above the link's);
2. decode validates the header (names, dtypes, sizes, ``max_state_bytes``, a free slot) -- a refusal is a
   plain gRPC status and nothing crossed the group -- posts the receive and replies ``ready``;
3. prefill sends the buffer; decode unpacks it into views (no copy), parks the state in the engine and replies
   with the ``HandoffAck``.

Transfers on one pair are serialised (a lock on the prefill side, a busy flag on the decode side): send/recv
order is then the only matching rule needed, for gloo and NCCL alike.

Failures: every wait on the group has a deadline (the caller's, capped by ``dist.timeout_s``) and watches the
other side's gRPC call; a peer that dies or stalls fails that hand-off only, with UNAVAILABLE (peer gone) or
DEADLINE_EXCEEDED (time limit), and the pair group is dropped on both sides (a stalled send/recv leaves a group
unusable), so the next hand-off connects a fresh one. A decode worker that lost a group (restarted, or
dropped it) answers NOT_FOUND with reason ``DIST_GROUP_UNKNOWN`` before anything was sent; the prefill worker
then reconnects once and retries. gloo cannot cancel a pending receive, so an abandoned wait finishes on a
daemon thread at its own deadline while the RPC thread returns at once; NCCL waits are polled and the
communicator aborted. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 0 here so that an NCCL error is reported
to the hand-off instead of tearing the server down.

gloo binds to the address of the host name; set ``GLOO_SOCKET_IFNAME`` when that is not the interface
between the workers. NCCL needs the two workers on different GPUs. The TCPStore listens on every interface and
has no authentication (like any torch.distributed rendezvous): keep its port inside the cluster network. The
payload is raw tensor bytes checked against the manifest; nothing received is ever unpickled.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from k3.model.state import SequenceState
from k3.protos.v1 import engine_pb2, engine_pb2_grpc
from k3.services.common.client import error_detail
from k3.services.common.config import ConfigError, documented
from k3.services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    K3Error,
    NotFound,
    Unavailable,
)
from k3.services.engine.handoff import MAX_REQUEST_ID_CHARS

log = logging.getLogger(__name__)

HANDOFF_MODES = ("grpc", "dist")
BACKENDS = ("auto", "gloo", "nccl")
ALIGN = 64
"""Byte alignment of every tensor in the payload (a multiple of any element size)."""
DTYPES = {name: getattr(torch, name) for name in
          ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8")}
"""dtypes a payload may carry, by their name on the wire."""
_POLL_S = 0.02
_GROUP_UNKNOWN = "DIST_GROUP_UNKNOWN"


@dataclass
class DistHandoffConfig:
    """The ``torch.distributed`` hand-off path (used when ``handoff: dist``)."""

    backend: str = documented(
        "auto", doc="auto (nccl when the model is on a CUDA device, else gloo), gloo or nccl; both workers agree."
    )
    store_port: int = documented(
        0, doc="Decode worker: TCP port of the rendezvous TCPStore peers join (0 = a free port, told to peers)."
    )
    timeout_s: float = documented(
        30.0, doc="Time limit of joining a pair group and of one transfer when the caller set no shorter deadline."
    )
    max_peers: int = documented(
        64, doc="Decode worker: most pair groups kept; beyond it the least recently used idle one is dropped."
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}", field="backend")
        if not 0 <= self.store_port <= 65535:
            raise ConfigError(f"must be in [0, 65535], got {self.store_port}", field="store_port")
        if not self.timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.timeout_s}", field="timeout_s")
        if self.max_peers < 1:
            raise ConfigError(f"must be >= 1, got {self.max_peers}", field="max_peers")


def check_handoff_mode(mode: str) -> None:
    if mode not in HANDOFF_MODES:
        raise ConfigError(f"must be one of {', '.join(HANDOFF_MODES)}, got {mode!r}", field="handoff")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl hand-off backend needs the model on a CUDA device, not {device}")
    return backend


class DistHandoffFailed(K3Error):
    """The decode worker refused a dist hand-off; carries its status code."""

    reason = "HANDOFF_FAILED"

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message, field="decode_address")
        self.code = code


# -- payload: tensors packed into one aligned byte buffer ----------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(spec: engine_pb2.TensorSpec) -> int:
    count = 1
    for d in spec.shape:
        count *= d
    return count * DTYPES[spec.dtype].itemsize


def payload_layout(specs: Sequence[engine_pb2.TensorSpec]) -> tuple[list[int], int]:
    """Offsets of the tensors in the buffer and its total size."""
    offsets, total = [], 0
    for spec in specs:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += _nbytes(spec)
    return offsets, total


def pack(tensors: dict[str, Tensor], device: torch.device) -> tuple[Tensor, list[engine_pb2.TensorSpec]]:
    """One uint8 buffer on ``device`` holding ``tensors`` in order, and its manifest."""
    specs = [engine_pb2.TensorSpec(name=name, dtype=_dtype_name(t.dtype), shape=list(t.shape))
             for name, t in tensors.items()]
    offsets, total = payload_layout(specs)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for offset, t in zip(offsets, tensors.values(), strict=True):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + flat.numel()].copy_(flat)
    return buffer, specs


def unpack(buffer: Tensor, specs: Sequence[engine_pb2.TensorSpec]) -> dict[str, Tensor]:
    """Views of ``buffer`` as the tensors of ``specs`` (no copy)."""
    offsets, _ = payload_layout(specs)
    return {spec.name: buffer[offset:offset + _nbytes(spec)].view(DTYPES[spec.dtype]).view(tuple(spec.shape))
            for offset, spec in zip(offsets, specs, strict=True)}


def state_tensors(state: SequenceState, last_logits: Tensor, token_ids: Sequence[int]) -> dict[str, Tensor]:
    """The payload of one hand-off: the state's tensors, then ``last_logits`` (float32) and ``token_ids`` (int32)."""
    device = last_logits.device
    return {**state.tensors(), "last_logits": last_logits.detach().to(torch.float32),
            "token_ids": torch.tensor(list(token_ids), dtype=torch.int32, device=device)}


def validate_header(header: engine_pb2.DistHandoffHeader, vocab_size: int, max_state_bytes: int) -> int:
    """Checks a header before anything is received; returns the payload size. ``InvalidArgument`` naming the field."""
    if not header.request_id:
        raise InvalidArgument("request_id", "is required", reason="MISSING_FIELD")
    if len(header.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
    if not header.group_key:
        raise InvalidArgument("group_key", "is required (call DistConnect first)", reason="MISSING_FIELD")
    if header.num_tokens < 1:
        raise InvalidArgument("num_tokens", f"must be >= 1, got {header.num_tokens}")
    if header.cached_tokens < 0:
        raise InvalidArgument("cached_tokens", f"must be >= 0, got {header.cached_tokens}")
    seen: set[str] = set()
    for i, spec in enumerate(header.tensors):
        where = f"tensors[{i}]"
        if spec.name in seen:
            raise InvalidArgument(f"{where}.name", f"{spec.name!r} appears twice", reason="BAD_MANIFEST")
        seen.add(spec.name)
        if spec.dtype not in DTYPES:
            raise InvalidArgument(f"{where}.dtype", f"must be one of {', '.join(DTYPES)}, got {spec.dtype!r}",
                                  reason="BAD_MANIFEST")
        if any(d < 0 for d in spec.shape) or len(spec.shape) > 8:
            raise InvalidArgument(f"{where}.shape", f"must have at most 8 dimensions >= 0, got {list(spec.shape)}",
                                  reason="BAD_MANIFEST")
    by_name = {spec.name: spec for spec in header.tensors}
    logits = by_name.get("last_logits")
    if logits is None or logits.dtype != "float32" or list(logits.shape) != [vocab_size]:
        raise InvalidArgument("tensors", f"must hold last_logits as float32 [{vocab_size}]", reason="BAD_LOGITS")
    if header.num_tokens > max_state_bytes:  # every token adds MLA rows to the state: bounds token_ids too
        raise InvalidArgument("num_tokens", f"{header.num_tokens} tokens cannot fit max_state_bytes "
                              f"{max_state_bytes}", reason="BAD_STATE_SIZE")
    tokens = by_name.get("token_ids")
    if tokens is None or tokens.dtype != "int32" or list(tokens.shape) != [header.num_tokens]:
        raise InvalidArgument("tensors", f"must hold token_ids as int32 [num_tokens = {header.num_tokens}]",
                              reason="BAD_MANIFEST")
    if header.key_ids and len(header.key_ids) != header.num_tokens:
        raise InvalidArgument("key_ids", f"has {len(header.key_ids)} ids for {header.num_tokens} prompt tokens "
                              "(empty, or one per token)", reason="BAD_KEY_IDS")
    state_bytes = sum(_nbytes(s) for s in header.tensors if s.name not in ("last_logits", "token_ids"))
    if not 0 < state_bytes <= max_state_bytes:
        raise InvalidArgument("tensors", f"state tensors must total [1, {max_state_bytes}] bytes, got "
                              f"{state_bytes}", reason="BAD_STATE_SIZE")
    return payload_layout(header.tensors)[1]


# -- process groups -------------------------------------------------------------------------------------------------
@contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for NCCL calls made from gRPC threads (whose current device is otherwise 0)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def _new_group(backend: str, store: dist.Store, rank: int, timeout_s: float, device: torch.device):
    """A standalone two-rank backend over ``store``, connected and checked by a one-element all-reduce."""
    timeout = datetime.timedelta(seconds=timeout_s)
    with _on(device):
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
            group = dist.ProcessGroupNCCL(store, rank, 2, timeout)
        else:
            group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        probe = torch.ones(1, device=device)
        _await(group.allreduce([probe]), backend, time.monotonic() + timeout_s, lambda: True, group,
               "joining the pair group")
    if probe.item() != 2:
        raise Unavailable(f"the pair group's handshake returned {probe.item()}, expected 2")
    return group


def _is_timeout(exc: BaseException) -> bool:
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def _await(work, backend: str, deadline: float, alive: Callable[[], bool], group, what: str) -> None:
    """Wait for ``work`` until ``deadline`` while ``alive()``; ``Unavailable`` / ``DeadlineExceeded`` otherwise.

    gloo: the (uncancellable) wait runs on a daemon thread with the deadline as its timeout, and this thread
    polls; NCCL: ``is_completed`` is polled and the communicator aborted on failure.
    """
    if backend == "nccl":
        while not work.is_completed():
            if time.monotonic() >= deadline or not alive():
                group.abort()
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"{what} did not finish in time", reason="HANDOFF_TIMEOUT")
                raise Unavailable(f"the peer went away while {what}", reason="PEER_GONE")
            time.sleep(_POLL_S)
        try:
            work.wait()
        except Exception as exc:
            raise Unavailable(f"{what} failed: {exc}", reason="PEER_GONE") from None
        return
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            outcome["error"] = None
        except BaseException as exc:  # reported to the waiting thread (or dropped if it gave up)
            outcome["error"] = exc

    waiter = threading.Thread(target=run, name="k3-dist-handoff-wait", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(_POLL_S)
        if waiter.is_alive() and not alive():
            raise Unavailable(f"the peer went away while {what}", reason="PEER_GONE")
    error = outcome.get("error")
    if error is not None:
        if _is_timeout(error) and time.monotonic() >= deadline - 0.05:
            raise DeadlineExceeded(f"{what} did not finish in time", reason="HANDOFF_TIMEOUT")
        raise Unavailable(f"{what} failed: {error}", reason="PEER_GONE")


def _drop(group) -> None:
    """Release a pair group that may be mid-operation (its peer gone): abort it, never wait on it."""
    try:
        group.abort()
    except Exception:  # already broken: nothing left to release
        pass


def _split_host(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


# -- decode side ---------------------------------------------------------------------------------------------------
class _PeerGroup:
    def __init__(self, key: str):
        self.key = key
        self.group = None
        self.error: BaseException | None = None
        self.joined = threading.Event()
        self.busy = threading.Lock()


class DistHandoffHost:
    """Decode side: the rendezvous store, the pair groups of connected prefill workers, receiving payloads."""

    def __init__(self, config: DistHandoffConfig, device: torch.device, vocab_size: int, max_state_bytes: int):
        self.config = config
        self.device = device
        self.backend = resolve_backend(config.backend, device)
        self.vocab_size = vocab_size
        self.max_state_bytes = max_state_bytes
        self.store = dist.TCPStore("0.0.0.0", config.store_port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=config.timeout_s))
        self.store_port = self.store.port
        self._lock = threading.Lock()
        self._groups: OrderedDict[str, _PeerGroup] = OrderedDict()
        self._closed = False

    def connect(self, request: engine_pb2.DistConnectRequest) -> engine_pb2.DistConnectResponse:
        if request.backend != self.backend:
            raise FailedPrecondition(f"this decode worker hands off over {self.backend}, the peer asked for "
                                     f"{request.backend!r}", field="backend", reason="BACKEND_MISMATCH")
        peer = _PeerGroup(f"k3-handoff/{uuid.uuid4().hex}")
        with self._lock:
            if self._closed:
                raise Unavailable("the decode worker is shutting down")
            self._groups[peer.key] = peer
            self._evict_idle()
        threading.Thread(target=self._join, args=(peer,), name="k3-dist-handoff-join", daemon=True).start()
        return engine_pb2.DistConnectResponse(group_key=peer.key, store_port=self.store_port, backend=self.backend)

    def _join(self, peer: _PeerGroup) -> None:
        try:
            peer.group = _new_group(self.backend, dist.PrefixStore(peer.key, self.store), 1, self.config.timeout_s,
                                    self.device)
        except BaseException as exc:
            log.warning("prefill peer did not join pair group %s: %s", peer.key, exc)
            peer.error = exc
            self._forget(peer)
        finally:
            peer.joined.set()

    def _evict_idle(self) -> None:
        while len(self._groups) > self.config.max_peers:
            idle = next((p for p in self._groups.values() if p.joined.is_set() and not p.busy.locked()), None)
            if idle is None:
                return
            del self._groups[idle.key]
            if idle.group is not None:
                _drop(idle.group)

    def _forget(self, peer: _PeerGroup) -> None:
        with self._lock:
            if self._groups.get(peer.key) is peer:
                del self._groups[peer.key]
        if peer.group is not None:
            _drop(peer.group)

    @contextmanager
    def receive(self, header: engine_pb2.DistHandoffHeader, alive: Callable[[], bool],
                time_remaining: Callable[[], float | None]) -> Iterator[Callable[[], dict[str, Tensor]]]:
        """Posts the receive of ``header``'s payload; the yielded function waits for it and returns its tensors.

        Validation errors are raised before anything is posted; a failed or abandoned receive drops the group.
        """
        validate_header(header, self.vocab_size, self.max_state_bytes)
        remaining = time_remaining()
        deadline = time.monotonic() + (self.config.timeout_s if remaining is None
                                       else min(remaining, self.config.timeout_s))
        with self._lock:
            peer = self._groups.get(header.group_key)
            if peer is not None:
                self._groups.move_to_end(peer.key)
        if peer is None:
            raise NotFound(f"no pair group {header.group_key!r} here (reconnect with DistConnect)",
                           field="group_key", reason=_GROUP_UNKNOWN)
        while not peer.joined.wait(_POLL_S):
            if time.monotonic() >= deadline or not alive():
                raise DeadlineExceeded("the prefill peer did not join its pair group in time", field="group_key")
        if peer.group is None:
            raise NotFound(f"pair group {header.group_key!r} failed to connect: {peer.error}", field="group_key",
                           reason=_GROUP_UNKNOWN)
        if not peer.busy.acquire(blocking=False):
            raise FailedPrecondition(f"pair group {header.group_key!r} is carrying another hand-off",
                                     field="group_key", reason="GROUP_BUSY")
        try:
            buffer = torch.empty(payload_layout(header.tensors)[1], dtype=torch.uint8, device=self.device)
            with _on(self.device):
                work = peer.group.recv([buffer], 0, 0)

            def wait() -> dict[str, Tensor]:
                with _on(self.device):
                    _await(work, self.backend, deadline, alive, peer.group,
                           f"receiving request {header.request_id!r}")
                return unpack(buffer, header.tensors)

            yield wait
        except BaseException:
            self._forget(peer)  # a receive that did not complete leaves the pair unusable
            raise
        finally:
            peer.busy.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._groups = list(self._groups.values()), OrderedDict()
        for peer in peers:
            if peer.group is not None:
                _drop(peer.group)


def receive_handoff(host: DistHandoffHost, header: engine_pb2.DistHandoffHeader, alive: Callable[[], bool],
                    time_remaining: Callable[[], float | None],
                    park: Callable[[SequenceState, Tensor, list[int], int], int]) -> Iterator[engine_pb2.DistHandoffReply]:
    """The replies of ``Decode.DistHandoff``: ``ready``, then the ack once ``park`` placed the state."""
    with host.receive(header, alive, time_remaining) as wait:
        yield engine_pb2.DistHandoffReply(ready=True)
        tensors = wait()
    last_logits, token_ids = tensors.pop("last_logits"), tensors.pop("token_ids").tolist()
    try:
        state = SequenceState.from_tensors(tensors, header.num_tokens, header.config_hash)
    except Exception as exc:  # untrusted manifest: any parse failure is the sender's error
        raise InvalidArgument("tensors", f"do not form a SequenceState: {exc}", reason="BAD_STATE") from None
    slot = park(state, last_logits, token_ids, header.cached_tokens)
    yield engine_pb2.DistHandoffReply(ack=engine_pb2.HandoffAck(request_id=header.request_id, slot=slot))


# -- prefill side --------------------------------------------------------------------------------------------------
class _StaleGroup(Exception):
    """The decode worker does not know our pair group (it restarted or dropped it): reconnect and retry."""


class _Peer:
    def __init__(self, key: str, group):
        self.key = key
        self.group = group
        self.lock = threading.Lock()


_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
             grpc.StatusCode.FAILED_PRECONDITION}
"""Statuses a decode worker answers before it posts a receive: the pair group stays in step."""


class DistHandoffSender:
    """Prefill side: one pair group per decode address, connected on first use, reconnected after a failure."""

    def __init__(self, config: DistHandoffConfig, device: torch.device):
        self.config = config
        self.device = device
        self.backend = resolve_backend(config.backend, device)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, threading.Lock] = {}

    def hand_off(self, address: str, channel: grpc.Channel, request_id: str, state: SequenceState,
                 last_logits: Tensor, token_ids: Sequence[int], cached_tokens: int, timeout_s: float,
                 cancelled: Callable[[], bool], key_ids: Sequence[int] | None = None) -> engine_pb2.HandoffAck:
        """Send one state to the decode worker at ``address``; raises ``K3Error``s (see the module docstring).
        ``key_ids``: the prompt's cache-key ids when they differ from ``token_ids`` (a prompt with images)."""
        deadline = time.monotonic() + timeout_s
        stub = engine_pb2_grpc.DecodeStub(channel)
        buffer, specs = pack(state_tensors(state, last_logits, token_ids), self.device)
        for attempt in range(2):
            peer = self._peer(address, stub, deadline)
            with peer.lock:
                header = engine_pb2.DistHandoffHeader(
                    request_id=request_id, group_key=peer.key, num_tokens=state.num_tokens,
                    config_hash=state.config_hash, cached_tokens=cached_tokens, tensors=specs,
                    key_ids=list(key_ids or ()))
                try:
                    return self._transfer(peer, stub, header, buffer, deadline, cancelled)
                except _StaleGroup:
                    self._discard(address, peer)
                    if attempt:
                        raise Unavailable(f"decode worker {address} lost two fresh pair groups in a row",
                                          field="decode_address", reason="PEER_GONE") from None
                except DistHandoffFailed as exc:
                    if exc.code not in _REFUSALS:
                        self._discard(address, peer)
                    raise
                except BaseException:
                    self._discard(address, peer)
                    raise
        raise AssertionError("unreachable")

    def _peer(self, address: str, stub, deadline: float) -> _Peer:
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None:
                return peer
            connecting = self._connecting.setdefault(address, threading.Lock())
        with connecting:  # one connection per address, even under concurrent first hand-offs
            with self._lock:
                peer = self._peers.get(address)
            if peer is not None:
                return peer
            peer = self._connect(address, stub, deadline)
            with self._lock:
                self._peers[address] = peer
            return peer

    def _connect(self, address: str, stub, deadline: float) -> _Peer:
        timeout = max(min(deadline - time.monotonic(), self.config.timeout_s), 0.001)
        try:
            reply = stub.DistConnect(engine_pb2.DistConnectRequest(backend=self.backend), timeout=timeout)
        except grpc.RpcError as exc:
            raise DistHandoffFailed(exc.code(), f"decode worker {address} refused a pair group: "
                                    f"{exc.code().name}: {exc.details()}") from None
        try:
            store = dist.TCPStore(_split_host(address), reply.store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            group = _new_group(self.backend, dist.PrefixStore(reply.group_key, store), 0, timeout, self.device)
        except K3Error:
            raise
        except Exception as exc:
            raise Unavailable(f"could not join the pair group of decode worker {address}: {exc}",
                              field="decode_address", reason="PEER_GONE") from None
        return _Peer(reply.group_key, group)

    def _transfer(self, peer: _Peer, stub, header, buffer: Tensor, deadline: float,
                  cancelled: Callable[[], bool]) -> engine_pb2.HandoffAck:
        call = stub.DistHandoff(header, timeout=max(deadline - time.monotonic(), 0.001))
        stop = threading.Event()

        def watch() -> None:  # cancellation reaches a blocked read through the call
            while not stop.wait(_POLL_S):
                if cancelled():
                    call.cancel()
                    return

        watcher = threading.Thread(target=watch, name="k3-dist-handoff-watch", daemon=True)
        watcher.start()
        try:
            first = self._read(call, header.request_id)
            if not first.ready:
                raise Unavailable("the decode worker answered without `ready`", reason="PROTOCOL")
            with _on(self.device):
                work = peer.group.send([buffer], 1, 0)
            _await(work, self.backend, deadline, lambda: call.is_active() and not cancelled(), peer.group,
                   f"sending request {header.request_id!r}")
            reply = self._read(call, header.request_id)
            return reply.ack
        finally:
            stop.set()
            call.cancel()

    @staticmethod
    def _read(call, request_id: str) -> engine_pb2.DistHandoffReply:
        try:
            return next(call)
        except StopIteration:
            raise Unavailable(f"the decode worker ended hand-off {request_id!r} early", reason="PROTOCOL") from None
        except grpc.RpcError as exc:
            detail = error_detail(exc)
            if exc.code() == grpc.StatusCode.NOT_FOUND and detail is not None and detail.reason == _GROUP_UNKNOWN:
                raise _StaleGroup() from None
            raise DistHandoffFailed(exc.code(), f"the decode worker did not take request {request_id!r}: "
                                    f"{exc.code().name}: {exc.details()}") from None

    def _discard(self, address: str, peer: _Peer) -> None:
        with self._lock:
            if self._peers.get(address) is peer:
                del self._peers[address]
        _drop(peer.group)

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            _drop(peer.group)
