"""State snapshots in the prefix cache (models with state layers), with no model: where a
prefill takes snapshots, how a hit is cut to one, how slots are attached, evicted and given back.
The engine-level proof (tokens equal to ``model.generate`` on every state family) is
``tests/api/test_state_layers.py``."""

from __future__ import annotations

from acb.core.block_pool import BlockPool
from acb.core.request import Request
from acb.core.scheduler import Scheduler

BS = 4


def make(rid: str, tokens: list[int], max_new: int = 2) -> Request:
    return Request(rid, list(tokens), max_new_tokens=max_new)


def sched(slots: int = 8, num_blocks: int = 64, budget: int = 64, speculative: int = 0) -> Scheduler:
    s = Scheduler(
        BlockPool(num_blocks, enable_caching=True, snapshot_slots=slots),
        block_size=BS,
        max_batch_tokens=budget,
        max_running=8,
    )
    s.kv.speculative_min_tokens = speculative  # (these tests' prompts are short)
    return s


def step(s: Scheduler):
    out = s.schedule()
    assert out is not None
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    return out


def finish(s: Scheduler) -> list:
    outs = []
    while s.has_work():
        outs.append(step(s))
    s.check_invariants()
    return outs


def starts(out) -> dict[str, int]:
    return {r.request_id: p for r, p in zip(out.requests, out.start_pos)}


def taken(out) -> list[tuple[int, int]]:
    """(offset in its segment, row) of each snapshot a step takes."""
    return [(off, row) for row, off, _ in out.snapshots]


PREFIX = list(range(100, 120))  # five blocks


def test_a_prompt_snapshots_its_last_block_and_the_one_before_its_last_token():
    s = sched()
    s.add(make("a", PREFIX))  # 20 tokens: ends on a block; the block before its last token is the 4th
    out = step(s)
    assert sorted(off for off, _ in taken(out)) == [16, 20]
    finish(s)
    assert s.pool.snapshots.num_attached == 2
    # the same prompt again: hits four blocks (its last token is always computed), from a snapshot
    s.add(make("b", PREFIX))
    out = step(s)
    assert out.restores and out.start_pos == [16]
    # an extension: hits all five
    s.add(make("c", PREFIX + [1, 2, 3]))
    out = step(s)
    assert starts(out)["c"] == 20 and len(out.restores) == 1
    finish(s)
    assert s.pool.snapshots.restores == 2


def test_a_hit_is_cut_back_to_the_last_block_with_a_snapshot():
    """The KV of a longer chain is cached, but only its snapshot's block can resume the state."""
    s = sched()
    s.add(make("a", PREFIX + list(range(1, 13))))  # 32 tokens: snapshots at 28 and 32 only
    finish(s)
    s.add(make("b", PREFIX + [9, 9, 9, 9, 9]))  # shares five blocks with a: none carries a snapshot
    out = step(s)
    assert out.start_pos == [0] and not out.restores
    # b snapshots where a's chain ended without one: the next request with that prefix hits it
    assert 20 in [off for off, _ in taken(out)]
    finish(s)
    s.add(make("c", PREFIX + [5, 5]))
    out = step(s)
    assert out.start_pos == [20] and len(out.restores) == 1
    finish(s)


def test_requests_queued_together_compute_their_shared_context_once():
    """Three prompts sharing five blocks, queued together: the first snapshots where they part, the
    others wait for it (one step) and then hit it."""
    s = sched()
    for i in range(3):
        s.add(make(f"r{i}", PREFIX + [i + 1] * 6))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["r0"]  # the other two wait for its snapshot
    assert 20 in [off for off, _ in taken(out)]
    out = step(s)
    assert sorted(r.request_id for r in out.requests if r.request_id != "r0") == ["r1", "r2"]
    assert len(out.restores) == 2
    finish(s)
    assert s.stats.prefix_hits == 40


def test_snapshots_of_a_chunked_prefill_fall_inside_its_chunks():
    s = sched(budget=6)
    s.add(make("a", PREFIX))
    offsets = []
    for out in finish(s):
        offsets += [(out.start_pos[0], off) for off, _ in taken(out)]
    assert [start + off for start, off in offsets] == [16, 20]


def test_slots_go_least_recently_used_first_and_with_their_block():
    s = sched(slots=2)
    s.add(make("a", PREFIX))
    finish(s)  # two slots: 16 and 20
    s.add(make("b", PREFIX + [1]))  # hits 20 (touched: the most recent)
    finish(s)
    s.add(make("c", [1] * 4))  # a new prompt needs a slot: it takes the least recently used one (16)
    finish(s)
    pool = s.pool
    held = {b for b, slot in enumerate(pool.snapshot) if slot >= 0}
    assert len(held) == 2 and s.kv.lookup(make("d", PREFIX + [2])) != []  # 20's snapshot survived
    assert pool.snapshots.evictions >= 1
    # the cache reset drops every snapshot with the digests
    s.kv.reset_prefix_cache()
    assert pool.snapshots.num_attached == 0 and pool.snapshots.num_free == 2
    s.check_invariants()


def test_an_evicted_block_gives_its_snapshot_back():
    s = sched(num_blocks=8)  # seven blocks: a second prompt of five evicts the first's
    s.add(make("a", PREFIX))
    finish(s)
    assert s.pool.snapshots.num_attached == 2
    s.add(make("b", list(range(200, 220))))
    finish(s)
    assert s.kv.lookup(make("c", PREFIX + [1])) == []
    s.check_invariants()


def test_a_failed_step_gives_its_slots_back_and_a_reset_discards_steps_in_flight():
    s = sched()
    s.add(make("a", PREFIX))
    out = s.schedule()
    assert out.snapshots
    s.abandon_step(out.step_id)
    assert s.pool.snapshots.num_free == 8
    s.cancel("a")
    s.check_invariants()
    s.add(make("b", PREFIX))
    out = s.schedule()
    s.kv.reset_prefix_cache()  # (weights changed while the step was in flight)
    s.update_from_output(out, [7] * len(out.sample_idx), None)
    assert s.pool.snapshots.num_attached == 0
    finish(s)


def test_no_snapshots_without_slots_or_caching():
    s = Scheduler(
        BlockPool(64, enable_caching=False, snapshot_slots=4), block_size=BS, max_batch_tokens=64, max_running=8
    )
    s.add(make("a", PREFIX))
    assert not s.schedule().snapshots
    s = Scheduler(BlockPool(64, enable_caching=True), block_size=BS, max_batch_tokens=64, max_running=8)
    s.add(make("a", PREFIX))
    assert not s.schedule().snapshots


def test_a_hit_for_layers_that_step_a_token_at_a_time_is_taken_for_a_short_rest_only():
    """Mamba1 resumes a hit a token at a time: past ``resume_max_tail`` prompt tokens after the hit,
    recomputing is faster, so the hit is not taken (nor waited for)."""
    s = Scheduler(
        BlockPool(64, enable_caching=True, snapshot_slots=8),
        block_size=BS,
        max_batch_tokens=64,
        max_running=8,
        resume_max_tail=6,
    )
    s.kv.speculative_min_tokens = 0
    s.add(make("a", PREFIX))
    finish(s)
    s.add(make("short", PREFIX + [1] * 6))  # six tokens after the hit: taken
    out = step(s)
    assert starts(out)["short"] == 20 and out.restores
    finish(s)
    s.add(make("long", PREFIX + [2] * 7))  # seven: recomputed whole
    out = step(s)
    assert starts(out)["long"] == 0 and not out.restores
    finish(s)


def test_snapshots_whose_size_grows_with_their_length_stay_within_a_token_budget():
    """Own caches cut at a block: a snapshot holds as many tokens as its position; the least
    recently used ones go until a new one fits the budget; one longer than the budget is not taken."""
    s = Scheduler(
        BlockPool(64, enable_caching=True, snapshot_slots=8, snapshot_tokens=40),
        block_size=BS,
        max_batch_tokens=64,
        max_running=8,
    )
    s.kv.speculative_min_tokens = 0
    s.add(make("a", PREFIX))  # snapshots at 16 and 20 tokens: 36 of 40
    finish(s)
    snaps = s.pool.snapshots
    assert snaps.num_attached == 2 and snaps.used_tokens == 36
    s.add(make("b", list(range(300, 312))))  # 8 and 12: the 16 and 20 go to fit them
    finish(s)
    assert snaps.used_tokens <= 40 and snaps.evictions >= 1
    s.add(make("c", list(range(400, 444))))  # 44 tokens: its 40- and 44-token snapshots never fit together
    finish(s)
    assert snaps.used_tokens <= 40
    s.check_invariants()


def test_a_scoring_request_snapshots_only_where_others_share_its_prompt():
    """Scoring (an evaluation's windows and contexts) takes no snapshot on the chance that its prompt
    comes again (each one inside a segment costs the state layers a call), only at junctions."""
    s = sched()
    alone = make("alone", PREFIX)
    alone.scoring = True
    s.add(alone)
    assert not step(s).snapshots
    finish(s)
    for i in range(2):
        r = make(f"r{i}", PREFIX + [i + 1] * 6)
        r.scoring = True
        s.add(r)
    out = step(s)
    assert [off for off, _ in taken(out)] == [20]  # where the two part
    finish(s)


def test_a_short_prompt_is_snapshotted_for_its_own_sake_only_where_it_costs_nothing():
    """Below ``speculative_min_tokens`` a generating prompt takes its own snapshots only where its
    prefill ends on a block (no extra call of the state layers): not inside a segment."""
    s = sched(speculative=100, budget=128)
    s.add(make("aligned", PREFIX))  # ends on a block: its last full block, free
    assert [off for off, _ in taken(step(s))] == [20]
    finish(s)
    s.add(make("ragged", PREFIX + [1, 2]))  # its last full block is inside the segment
    assert not step(s).snapshots
    finish(s)
    s.add(make("long", list(range(500, 602))))  # 102 tokens: both, inside the segment
    assert [off for off, _ in taken(step(s))] == [100]
    finish(s)
