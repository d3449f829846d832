"""What callers receive, built by acb.core.deliveries.DeliveryBuilder, without an engine."""

from __future__ import annotations

from dataclasses import replace

from acb.core.deliveries import DeliveryBuilder
from acb.core.messages import EngineRequest
from acb.core.request import Request
from acb.core.request_builder import build_request
from acb.outputs import FinishReason, RequestStatus
from acb.sampling_params import FALLBACK


def submit(rid: str, key: int, *, n: int = 1, max_new: int = 2, logprobs: bool = False) -> Request:
    params = replace(FALLBACK, n=n, logprobs=1 if logprobs else None)
    return build_request(EngineRequest(rid, key, (5, 6, 7), params, max_new, frozenset(), 0, n), None)


def members(head: Request) -> list[Request]:
    return head.group.members if head.group is not None else [head]


def sample(req: Request, token: int, lp: float | None = None) -> None:
    """What ``Scheduler.update_from_output`` does to a sample: record its token, and end it
    FINISHED when it is done."""
    top = [(token, lp)] if lp is not None else None
    if req.append_token(token, lp, 0.0, top):
        req.status = RequestStatus.FINISHED


def test_one_token_per_request_per_step_and_the_outcome_on_the_last():
    released: list[str] = []  # the ids the builder gave back
    b = DeliveryBuilder(released.append)
    a, c = submit("a", 1, max_new=2), submit("c", 2, max_new=1, logprobs=True)
    sample(a, 10)
    sample(c, 20, -0.5)
    items, recorded = b.step([a, c], [])
    assert recorded == 2 and [(d.key, d.token_ids) for d in items] == [(1, [10]), (2, [20])]
    assert items[0].final is None and items[0].logprobs is None
    assert items[1].logprobs == [-0.5] and items[1].top == [[(20, -0.5)]]
    assert items[1].final is not None and items[1].final.generated_tokens == [20]
    assert released == ["c"]
    sample(a, 11)
    items, _ = b.step([a], [])
    assert items[0].final is not None and items[0].final.generated_tokens == [10, 11] and released == ["c", "a"]


def test_a_group_outcome_rides_on_its_sinks_last_item_once_every_sample_ended():
    released: list[str] = []  # the ids the builder gave back
    b = DeliveryBuilder(released.append)
    s0, s1 = members(submit("g", 7, n=2, max_new=1))
    sample(s0, 3)
    sample(s1, 4)
    items, recorded = b.step([s0, s1], [])
    assert recorded == 2 and [(d.sample_index, d.token_ids) for d in items] == [(0, [3]), (1, [4])]
    assert items[0].final is None and items[1].final is not None
    assert [s.generated_tokens for s in items[1].final.samples] == [[3], [4]]
    assert sorted(released) == ["g", "g#1"]
    assert b.finals([s0, s1]) == []  # delivered once


def test_a_grammar_dead_end_records_no_token_and_scored_requests_end_without_one():
    b = DeliveryBuilder(lambda rid: None)
    dead, scored = submit("d", 1), submit("s", 2)
    dead.finish_reason, dead.status = FinishReason.GRAMMAR, RequestStatus.FINISHED
    scored.status = RequestStatus.FINISHED
    items, recorded = b.step([dead], [scored])
    assert recorded == 0
    assert [(d.key, d.token_ids, d.final is not None) for d in items] == [(1, [], True), (2, [], True)]


def test_outcome_only_deliveries_and_the_dying_engines_bare_output():
    b = DeliveryBuilder(lambda rid: None)
    req = submit("x", 3)
    req.status, req.finish_reason = RequestStatus.CANCELLED, FinishReason.CANCELLED
    [d] = b.finals([req])
    assert d.key == 3 and d.token_ids == [] and d.final.status == RequestStatus.CANCELLED
    out = b.dead_output(req, "boom")
    assert out.status == RequestStatus.FAILED and out.error == "boom" and out.prompt_ids == [5, 6, 7]
