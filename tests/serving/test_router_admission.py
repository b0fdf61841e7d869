"""Admission: separate long/short budgets, so a burst of long prompts cannot starve short requests."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from router_cluster import inference_stub, start_cluster, wait_for

from k3.protos.v1 import inference_pb2
from k3.services.common.client import error_detail
from k3.services.common.errors import DeadlineExceeded, ResourceExhausted
from k3.services.router.admission import Admission, AdmissionClass, Cancelled
from k3.services.router.config import AdmissionConfig

pytestmark = pytest.mark.timeout(180)


def _in_thread(fn):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    thread.start()
    return thread, out


def _outcome(fn):
    try:
        fn()
        return "admitted"
    except Exception as exc:  # the outcome is what the test inspects
        return exc


def test_budgets_are_separate_and_fifo():
    admission = Admission(AdmissionConfig(long_threshold_tokens=100, long_max_concurrency=1,
                                          long_max_queued_tokens=250, short_max_concurrency=2,
                                          short_max_queued_tokens=0))
    assert admission.classify(99) is admission.short and admission.classify(100) is admission.long
    long = admission.long
    long.acquire(120)
    waiting, out = _in_thread(lambda: long.acquire(120))
    wait_for(lambda: long.stats().queued == 1, what="the second long request to queue")
    with pytest.raises(ResourceExhausted) as info:
        long.acquire(140)  # 120 queued + 140 > 250
    assert info.value.reason == "ADMISSION_BUDGET"
    assert "long requests are over budget" in info.value.message and "250" in info.value.message
    # The long class is saturated, yet short requests run at once (their own budget).
    admission.short.acquire(10)
    admission.short.acquire(10)
    with pytest.raises(ResourceExhausted, match="short requests are over budget"):
        admission.short.acquire(10)  # short concurrency 2 reached and no queue budget
    long.release()
    waiting.join(10)
    assert out == ["admitted"] and long.stats() == long.stats().__class__(1, 0, 0, 2, 1)


def test_waiters_leave_on_cancel_and_deadline():
    cls = AdmissionClass("long", max_concurrency=1, max_queued_tokens=1000)
    cls.acquire(10)
    flag = threading.Event()
    cancelled, out_c = _in_thread(lambda: cls.acquire(300, cancelled=flag.is_set))
    timed, out_t = _in_thread(lambda: cls.acquire(300, deadline=time.monotonic() + 0.2))
    wait_for(lambda: cls.stats().queued == 2 or out_t, what="two waiters")
    flag.set()
    cls.wake()
    cancelled.join(10)
    timed.join(10)
    assert isinstance(out_c[0], Cancelled) and isinstance(out_t[0], DeadlineExceeded)
    assert cls.stats().queued == 0 and cls.stats().queued_tokens == 0  # their tokens left the budget
    cls.release()
    cls.acquire(10)  # free again


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    c.stop()


def test_long_burst_does_not_starve_short_requests(cluster):
    router = cluster.start_router(AdmissionConfig(long_threshold_tokens=200, long_max_concurrency=1,
                                                  long_max_queued_tokens=300, short_max_concurrency=4,
                                                  short_max_queued_tokens=1000))
    admission = router.service.admission
    channel, stub = inference_stub(router)
    rng = random.Random(5)
    outcomes: dict[str, object] = {}

    def long_request(i: int) -> None:
        request = inference_pb2.GenerateRequest(
            request_id=f"long-{i}", prompt_token_ids=[rng.randrange(8, 264) for _ in range(250)],
            sampling=inference_pb2.SamplingParams(max_tokens=3000))
        try:
            outcomes[f"long-{i}"] = list(stub.Generate(request, timeout=120))[-1].finish_reason
        except grpc.RpcError as exc:
            outcomes[f"long-{i}"] = exc

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    # One long request runs, one waits (250 tokens fit the 300-token queue), three are refused.
    wait_for(lambda: admission.long.stats().rejected == 3 and admission.long.stats().queued == 1,
             what="the long burst to fill its budget")
    try:
        for i in range(4):
            prompt = [rng.randrange(8, 264) for _ in range(20)]
            responses = list(stub.Generate(inference_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(max_tokens=2)), timeout=120))
            assert responses[-1].finish_reason in ("stop", "length"), i
        # The short requests completed while the long class was still saturated.
        assert admission.long.stats().running == 1 and admission.long.stats().queued == 1
        assert admission.short.stats().admitted == 4 and admission.short.stats().rejected == 0
    finally:
        for i in range(5):  # the running one and the one waiting in admission both end with "abort"
            stub.Abort(inference_pb2.AbortRequest(request_id=f"long-{i}"), timeout=10)
        for t in threads:
            t.join(60)
        channel.close()
    refused = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
    assert len(refused) == 3
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_detail(error).reason == "ADMISSION_BUDGET"
        assert "long requests are over budget" in error.details()
    assert sorted(o for o in outcomes.values() if isinstance(o, str)) == ["abort", "abort"]
