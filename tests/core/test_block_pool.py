from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acb.core.block_pool import SCRATCH_BLOCK, BlockPool


def test_allocate_all_or_nothing_and_scratch_reserved():
    pool = BlockPool(5)
    assert pool.num_usable == 4 and pool.num_free == 4
    a = pool.allocate(3)
    assert a is not None and SCRATCH_BLOCK not in a and len(set(a)) == 3
    assert pool.allocate(2) is None  # only one left: nothing taken
    assert pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 4
    pool.check()


def test_refcounts_shared_blocks():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.incref(a)
    pool.free(a)
    assert pool.num_free == 1  # still referenced once
    pool.free(a)
    assert pool.num_free == 3
    with pytest.raises(AssertionError):
        pool.free(a)  # double free is caught
    pool.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "fork"]), st.integers(0, 6)), max_size=80))
def test_random_ops_keep_invariants(ops):
    pool = BlockPool(12)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            got = pool.allocate(n)
            if got is None:
                assert n > pool.num_free
            else:
                held.append(got)
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "fork" and held:
            src = held[n % len(held)]
            pool.incref(src)
            held.append(list(src))
        pool.check()
        assert pool.num_free + pool.num_used == pool.num_usable
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_usable
    pool.check()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "append", "fork", "free", "register", "hit", "reset"]), st.integers(0, 7)),
        max_size=120,
    )
)
def test_random_ops_with_prefix_cache_keep_invariants(ops):
    """allocate/append/fork/free/cache-hit/evict in any order keep every invariant, and a
    block that is referenced is never handed out again."""
    from acb.core.block_pool import block_digest

    pool = BlockPool(10)
    seqs: list[list[int]] = []
    names = [block_digest(b"", [i]) for i in range(8)]
    for op, n in ops:
        referenced = {b for s in seqs for b in s}
        if op == "alloc":
            got = pool.allocate(n % 4)
            if got is not None:
                assert not referenced & set(got), "handed out a referenced block"
                seqs.append(got)
        elif op == "append" and seqs:
            got = pool.allocate(1)
            if got is not None:
                assert got[0] not in referenced
                seqs[n % len(seqs)].extend(got)
        elif op == "fork" and seqs:
            src = seqs[n % len(seqs)]
            pool.incref(src)
            seqs.append(list(src))
        elif op == "free" and seqs:
            pool.free(seqs.pop(n % len(seqs)))
        elif op == "register" and seqs and seqs[n % len(seqs)]:
            pool.register(seqs[n % len(seqs)][0], names[n])
        elif op == "hit":
            found = pool.lookup([names[n]])
            if found:
                assert pool.digests[found[0]] == names[n]
                pool.take(found)
                seqs.append(found)
        elif op == "reset":
            pool.reset_cache()
        pool.check()
        assert pool.num_free + pool.num_used == pool.num_usable
        for b in range(1, pool.num_blocks):
            assert pool.ref_counts[b] == sum(s.count(b) for s in seqs)
    for s in seqs:
        pool.free(s)
    assert pool.num_free == pool.num_usable
    pool.check()
