from services.scheduler.admission import DeadlineQueue, Queue, admit
from shared.messages import ErrorCode, Rejected


def test_a_request_that_can_still_make_its_ttft_is_queued_with_a_deadline() -> None:
    d = admit(now=10.0, arrival=10.0, ttft_slo=2.0, service_s=0.5, queued=0, max_queued=8)
    assert d == Queue(deadline=11.5)


def test_a_request_that_cannot_make_its_ttft_is_rejected_early_with_the_reason() -> None:
    d = admit(now=11.6, arrival=10.0, ttft_slo=2.0, service_s=0.5, queued=0, max_queued=8)
    assert isinstance(d, Rejected) and d.code is ErrorCode.NO_CAPACITY and "TTFT" in d.message


def test_a_full_queue_rejects_as_overloaded() -> None:
    d = admit(now=10.0, arrival=10.0, ttft_slo=2.0, service_s=0.5, queued=8, max_queued=8)
    assert isinstance(d, Rejected) and d.code is ErrorCode.OVERLOADED


def test_the_queue_expires_past_deadlines_and_keeps_arrival_order() -> None:
    q: DeadlineQueue[str] = DeadlineQueue()
    q.push("late", 5.0)
    t = q.push("early", 3.0)
    q.push("third", 9.0)
    assert [i for _, i in q.waiting()] == ["late", "early", "third"]
    q.remove(t)
    assert q.expire(6.0) == ["late"]
    assert len(q) == 1 and q.next_deadline() == 9.0
