"""Scheduler bookkeeping with no model: the runner is simulated by feeding sampled tokens back."""

from __future__ import annotations

import random

import pytest

from acb.core.block_pool import BlockPool
from acb.core.request import Request
from acb.core.scheduler import Scheduler
from acb.outputs import FinishReason, RequestStatus


def make(rid: str, prompt_len: int, max_new: int = 4) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), max_new_tokens=max_new)


def sched(num_blocks=64, block_size=4, budget=32, max_running=8, policy="fifo", margin=0.0, caching=False) -> Scheduler:
    return Scheduler(
        BlockPool(num_blocks, enable_caching=caching),
        block_size=block_size,
        max_batch_tokens=budget,
        max_running=max_running,
        policy=policy,
        safety_margin=margin,
    )


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    if out is None:
        return None, [], []
    progressed, finished = s.update_from_output(out, [token] * len(out.sample_idx), None)
    return out, progressed, finished


def test_budget_and_chunking():
    s = sched(budget=10)
    s.add(make("a", 25))
    s.add(make("b", 3))
    out = s.schedule()
    assert out.num_tokens == 10 and out.num_new == [10] and out.sample_idx == []
    s.update_from_output(out, [], None)
    out = s.schedule()
    assert out.start_pos == [10] and out.num_new == [10]
    s.update_from_output(out, [], None)
    out = s.schedule()  # last 5 of a, then 3 of b
    assert out.num_new == [5, 3] and out.start_pos == [20, 0] and out.sample_idx == [0, 1]
    assert out.num_tokens <= 10
    s.check_invariants()


def test_whole_prefill_never_chunks_a_prompt():
    """A model whose state layers cannot resume a prefill (Mamba1): a prompt is scheduled whole,
    past the budget by at most the step's decodes; one longer than a step waits for a step of
    its own; nothing is ever split."""
    s = sched(budget=10)
    s.whole_prefill = True
    s.add(make("a", 4))
    run_step(s)  # a prefilled, decoding from now on
    s.add(make("b", 10))  # fits a step, not the 9 left beside a's decode: taken whole, past the budget by 1
    s.add(make("c", 25))  # longer than a step: waits for a step with nothing else
    s.add(make("d", 2))  # behind c: FIFO
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_new == [1, 10]
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    while any(r.request_id != "c" for r in s.running):  # a and b decode to their end; c waits
        out = s.schedule()
        assert "c" not in [r.request_id for r in out.requests]
        s.update_from_output(out, [7] * len(out.sample_idx), None)
    out = s.schedule()  # alone: the whole 25-token prompt in one step
    assert [r.request_id for r in out.requests] == ["c"] and out.num_new == [25]
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    out = s.schedule()  # d beside c's decode
    assert [r.request_id for r in out.requests] == ["c", "d"] and out.num_new == [1, 2]
    s.check_invariants()


def test_decodes_first_then_admission_fifo():
    s = sched(budget=6)
    s.add(make("a", 4))
    run_step(s)  # a prefilled, sampled one token
    s.add(make("b", 8))
    out = s.schedule()
    # a decodes (1 token) before b's chunk (5 tokens)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new == [1, 5]


def test_prefill_first_order():
    s = sched(budget=6, policy="prefill_first")
    s.add(make("a", 4))
    run_step(s)
    s.add(make("b", 8))
    out = s.schedule()
    # the whole budget goes to b's prefill; a's decode waits for what is left
    assert [r.request_id for r in out.requests] == ["b"] and out.num_new == [6]
    s.update_from_output(out, [], None)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["b", "a"] and out.num_new == [2, 1]


def test_strict_fifo_admission_and_request_cap():
    s = sched(budget=100, max_running=2)
    for i in range(4):
        s.add(make(f"r{i}", 3))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preempts_newest_and_keeps_generated_tokens():
    # 6 usable blocks of 4 tokens; three requests of 8 prompt tokens each take 2 blocks
    s = sched(num_blocks=7, block_size=4, budget=64)
    for i in range(3):
        s.add(make(f"r{i}", 8, max_new=6))
    out, _, _ = run_step(s)
    assert len(out.requests) == 3 and s.pool.num_free == 0
    gen_before = list(s.live["r2"].token_ids)
    out, _, _ = run_step(s)  # every request needs a 3rd block: the newest (r2) is preempted
    assert s.stats.preemptions >= 1
    victim = s.live["r2"]
    assert victim.status == RequestStatus.PENDING and victim.num_preemptions == 1
    assert victim.token_ids == gen_before  # generated token kept for recompute
    assert victim.num_computed_tokens == 0 and not victim.block_ids
    assert s.waiting[0] is victim
    s.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_finishes_without_leaks(caching):
    rnd = random.Random(0)
    s = sched(num_blocks=20, block_size=4, budget=16, max_running=6, caching=caching)
    reqs = [make(f"r{i}", rnd.randint(1, 30), max_new=rnd.randint(1, 12)) for i in range(30)]
    expected = {r.request_id: r.max_new_tokens for r in reqs}
    for r in reqs[:10]:
        s.add(r)
    pending = reqs[10:]
    finished = {}
    steps = 0
    while s.has_work() or pending:
        if pending and rnd.random() < 0.3:
            s.add(pending.pop(0))
        out, progressed, done = run_step(s)
        assert out is not None or not s.has_work()
        if out is not None:
            assert out.num_tokens <= 16 and out.num_seqs <= 6
        for r in done:
            finished[r.request_id] = r
        s.check_invariants()
        steps += 1
        assert steps < 5000, "no progress"
    assert len(finished) == 30
    for rid, r in finished.items():
        assert r.num_generated == expected[rid] and r.finish_reason == FinishReason.LENGTH
    assert s.pool.num_used == 0
    if caching:  # prompts share prefixes (all start 3, 4, 5...): the cache must have been used
        assert s.stats.prefix_hits > 0
    else:
        assert s.stats.preemptions > 0


def test_cancel_frees_blocks_in_any_state():
    s = sched(budget=4)
    s.add(make("a", 10))
    s.add(make("b", 3))
    run_step(s)  # a partly prefilled
    assert s.cancel("a") is not None and s.cancel("b") is not None
    assert s.cancel("nope") is None
    assert not s.has_work() and s.pool.num_used == 0
    s.check_invariants()


def test_stop_token_finishes():
    s = sched()
    r = Request("a", [3, 4], max_new_tokens=10, stop_token_ids=frozenset({9}))
    s.add(r)
    _, _, done = run_step(s, token=5)
    assert not done
    _, _, done = run_step(s, token=9)
    assert done == [r] and r.finish_reason == FinishReason.STOP and r.token_ids[-1] == 9
    assert s.pool.num_used == 0


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_oldest_always_progresses_under_pressure(policy):
    # a cache that fits exactly one max-length request: everything still finishes
    s = sched(num_blocks=5, block_size=4, budget=8, max_running=4, policy=policy)
    for i in range(5):
        s.add(make(f"r{i}", 10, max_new=6))
    steps = 0
    while s.has_work():
        run_step(s)
        s.check_invariants()
        steps += 1
        assert steps < 2000
    assert s.stats.finished == 5 and s.pool.num_used == 0


def test_prefix_cache_hit_reuses_blocks_and_recomputes_last_token():
    s = sched(block_size=4, caching=True)
    a = make("a", 10, max_new=2)
    s.add(a)
    run_step(s)
    a_blocks = list(a.block_ids)
    # same 10-token prompt: 2 full blocks cached, the rest (2 tokens) recomputed
    b = make("b", 10, max_new=2)
    s.add(b)
    out = s.schedule()
    assert out.requests[-1] is b and out.start_pos[-1] == 8 and out.num_new[-1] == 2
    assert b.block_ids[:2] == a_blocks[:2] and b.num_cached_tokens == 8
    assert s.pool.ref_counts[a_blocks[0]] == 2
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    # a block-aligned prompt that is entirely cached still computes its last block
    c = make("c", 8, max_new=2)
    s.add(c)
    out = s.schedule()
    assert out.start_pos[-1] == 4 and out.num_new[-1] == 4
    s.check_invariants()


def test_prefix_cache_lru_eviction_and_no_handout_while_referenced():
    s = sched(num_blocks=7, block_size=4, caching=True)  # 6 usable blocks
    a = make("a", 9, max_new=1)
    s.add(a)
    run_step(s)  # a finishes: its 2 full blocks stay cached, free
    assert not s.running and s.pool.num_cached == 2 and s.pool.num_free == 6
    cached_a = set(s.pool.cached.values())
    # a request with a different prompt takes free blocks: uncached ones go first (LRU),
    # and a's tail block is evicted before its head
    b = Request("b", [100 + i for i in range(16)], max_new_tokens=1)
    s.add(b)
    run_step(s)
    assert s.pool.num_cached >= 1  # b needed 4 of 6 blocks: a's head block survived
    head_digest = a.block_hashes[0]
    assert head_digest in s.pool.cached
    # while a block is referenced it is never handed out by allocate
    c = make("c", 9, max_new=3)
    s.add(c)
    out = s.schedule()
    held = set(c.block_ids)
    more = s.pool.allocate(s.pool.num_free)
    assert not held & set(more)
    s.pool.free(more)
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    s.check_invariants()
    assert cached_a  # sanity: a had cached blocks to begin with


def test_reset_prefix_cache_keeps_blocks_in_use():
    s = sched(block_size=4, caching=True)
    a = make("a", 12, max_new=5)
    s.add(a)
    run_step(s)
    assert s.pool.num_cached == 3  # 12 computed prompt tokens = 3 full blocks
    assert s.pool.reset_cache() == 3 and s.pool.num_cached == 0
    s.check_invariants()
    while s.has_work():
        run_step(s)
    assert s.pool.num_used == 0


def test_same_prefix_in_one_step_waits_and_hits():
    s = sched(block_size=4, budget=64, caching=True)
    for i in range(3):
        s.add(make(f"r{i}", 10, max_new=2))
    out = s.schedule()
    # r1 and r2 would compute r0's blocks again: they wait one step instead
    assert [r.request_id for r in out.requests] == ["r0"]
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    out = s.schedule()
    assert [r.request_id for r in out.requests][1:] == ["r1", "r2"]
    assert out.start_pos[1:] == [8, 8]  # both hit the two cached blocks
    s.check_invariants()
