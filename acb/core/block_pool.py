"""KV-cache blocks: reference counts, an LRU free queue and the prefix cache.

Block 0 is reserved as scratch: padded rows write there and nothing reads it, so it is
never handed out.

Prefix cache: a full block is known by a chained SHA-256 digest of (the previous block's
digest, its token ids, the request's cache salt). SHA-256 is collision-resistant (no
collision has ever been found; a random one has probability ~2^-128 even over 2^64
blocks), so equal digests mean equal token prefixes and a hit needs no token comparison.
A block whose last reference goes away keeps its digest and stays findable while it sits
in the free queue; allocation takes the least recently freed block first and forgets its
digest then. Blocks of a sequence are freed tail first, so a prefix's tail is evicted
before its head.

State snapshots (models with state layers: linear attention, Mamba, short convolutions): a
cached block's KV alone cannot resume such a model, which also needs the layers' state where the
block ends. A :class:`SnapshotPool` slot holds that state; a cached block may carry one
(``BlockPool.snapshot``). A slot goes back when its block is evicted, when the cache is reset, or
(least recently used first) when a new snapshot needs a slot and none is free; the block keeps its
KV then, only state hits up to it are lost.

Invariants (checked by :meth:`BlockPool.check`):

- every usable block is either free (ref count 0, in the free queue once) or referenced;
- ``num_free + num_used == num_usable``;
- the digest map and the per-block digests agree;
- a block carrying a snapshot is cached, and the snapshot pool agrees on which block holds a slot.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

SCRATCH_BLOCK = 0


def block_digest(parent: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
    """The chained digest of one full block."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(salt)
    return h.digest()


class BlockPool:
    """Hands out KV blocks all-or-nothing, takes them back by reference count, caches prefixes."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, snapshot_slots: int = 0, snapshot_tokens: int = 0
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.digests: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # front = evicted first
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.evictions = 0  # cached blocks handed out for new content (their digest forgotten)
        # state snapshots (see the module docstring): the slot each cached block carries, or -1
        self.snapshots = SnapshotPool(snapshot_slots, snapshot_tokens) if snapshot_slots and enable_caching else None
        self.snapshot = [-1] * num_blocks

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with ref count 1, least recently freed first; ``None`` (nothing taken) if
        fewer are free. A cached block taken here is evicted from the prefix cache."""
        if n > len(self._free):
            return None
        popitem = self._free.popitem
        rc, digests = self.ref_counts, self.digests
        out = []
        for _ in range(n):
            b, _ = popitem(last=False)
            d = digests[b]
            if d is not None:
                del self.cached[d]
                digests[b] = None
                self.evictions += 1
                if self.snapshot[b] >= 0:
                    self.drop_snapshot(b)
            rc[b] = 1
            out.append(b)
        return out

    def incref(self, blocks: list[int]) -> None:
        rc = self.ref_counts
        for b in blocks:
            assert rc[b] > 0, f"incref of free block {b}"
            rc[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue, tail first."""
        rc = self.ref_counts
        free = self._free
        for b in reversed(blocks):
            assert rc[b] > 0, f"double free of block {b}"
            rc[b] -= 1
            if rc[b] == 0:
                free[b] = None

    # ---------------------------------------------------------- prefix cache
    def lookup(self, digests: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``digests`` (nothing is taken)."""
        out = []
        cached = self.cached
        for d in digests:
            b = cached.get(d)
            if b is None:
                break
            out.append(b)
        return out

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are in the free queue (taking them uses free capacity)."""
        rc = self.ref_counts
        return sum(1 for b in blocks if rc[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """Add a reference to cached blocks found by :meth:`lookup` (reviving free ones)."""
        rc = self.ref_counts
        free = self._free
        for b in blocks:
            if rc[b] == 0:
                del free[b]
            rc[b] += 1

    def register(self, block: int, digest: bytes) -> None:
        """Make a full, computed block findable by its digest (first holder of a digest wins)."""
        if not self.enable_caching or self.digests[block] is not None or digest in self.cached:
            return
        self.cached[digest] = block
        self.digests[block] = digest

    def reset_cache(self) -> int:
        """Forget every digest and snapshot (blocks in use stay in use); returns how many digests
        were forgotten."""
        n = len(self.cached)
        for b in self.cached.values():
            self.digests[b] = None
            if self.snapshot[b] >= 0:
                self.drop_snapshot(b)
        self.cached.clear()
        return n

    # ------------------------------------------------------------- snapshots
    def attach_snapshot(self, digest: bytes, slot: int) -> bool:
        """Let the cached block known by ``digest`` carry the state snapshot in ``slot`` (the
        state where that block ends). False (the slot is the caller's to give back) when no block
        is cached under ``digest`` or it carries one already (the first holder wins)."""
        snaps = self.snapshots
        assert snaps is not None
        b = self.cached.get(digest)
        if b is None or self.snapshot[b] >= 0:
            return False
        self.snapshot[b] = slot
        snaps.attach(slot, b)
        return True

    def drop_snapshot(self, block: int) -> None:
        """``block`` no longer carries a snapshot; its slot is free."""
        snaps = self.snapshots
        assert snaps is not None
        snaps.release(self.snapshot[block])
        self.snapshot[block] = -1

    def take_snapshot_slot(self, tokens: int = 0) -> int | None:
        """A slot for a new snapshot of ``tokens`` tokens: a free one, else the least recently used
        ones' (their blocks keep their KV and lose the snapshot) until one is free and, with a token
        budget, the snapshot fits; None when the pending ones leave no room."""
        snaps = self.snapshots
        assert snaps is not None
        if snaps.token_budget and tokens > snaps.token_budget:
            return None
        while not snaps.num_free or not snaps.fits(tokens):
            oldest = snaps.oldest()
            if oldest is None:
                return None
            self.drop_snapshot(snaps.block_of[oldest])
        return snaps.take_free(tokens)

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every engine test)."""
        free = self._free
        assert SCRATCH_BLOCK not in free, "the scratch block is in the free queue"
        for b in range(1, self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc} but free={b in free}"
        assert self.ref_counts[SCRATCH_BLOCK] == 0
        for d, b in self.cached.items():
            assert self.digests[b] == d, f"block {b}: digest map and block digest disagree"
        assert sum(d is not None for d in self.digests) == len(self.cached)
        snaps = self.snapshots
        if snaps is not None:
            for b, slot in enumerate(self.snapshot):
                if slot >= 0:
                    assert self.digests[b] is not None, f"block {b} carries snapshot {slot} but is not cached"
                    assert snaps.block_of[slot] == b, f"snapshot {slot}: held by block {snaps.block_of[slot]}, not {b}"
            assert sum(s >= 0 for s in self.snapshot) == len(snaps._lru)
            assert snaps.used_tokens == sum(snaps.tokens), "snapshot tokens miscounted"
            assert not snaps.token_budget or snaps.used_tokens <= snaps.token_budget, "snapshot tokens over budget"
        else:
            assert all(s < 0 for s in self.snapshot)


class SnapshotPool:
    """Slots of state snapshots: free, pending (taken for a step whose output is not recorded
    yet) or attached to a cached block (kept in least-recently-used order). With a token budget
    (snapshots whose size grows with their position: the model's own caches cut at a block), the
    slots' tokens together stay within it."""

    def __init__(self, num_slots: int, token_budget: int = 0) -> None:
        self.num_slots = num_slots
        self.token_budget = token_budget
        self.tokens = [0] * num_slots  # each taken slot's snapshot length
        self.used_tokens = 0
        self._free = list(range(num_slots - 1, -1, -1))
        self.block_of = [-1] * num_slots  # the block an attached slot's snapshot belongs to
        self._lru: OrderedDict[int, None] = OrderedDict()  # attached slots, least recently used first
        self.restores = 0  # snapshots read by prefix hits
        self.evictions = 0  # snapshots dropped for a newer one while their block stayed cached

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_attached(self) -> int:
        return len(self._lru)

    def fits(self, tokens: int) -> bool:
        return not self.token_budget or self.used_tokens + tokens <= self.token_budget

    def take_free(self, tokens: int = 0) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.tokens[slot] = tokens
        self.used_tokens += tokens
        return slot

    def oldest(self) -> int | None:
        if not self._lru:
            return None
        self.evictions += 1
        return next(iter(self._lru))

    def attach(self, slot: int, block: int) -> None:
        self.block_of[slot] = block
        self._lru[slot] = None

    def touch(self, slot: int) -> None:
        """A prefix hit read the slot: it is the most recently used."""
        self._lru.move_to_end(slot)
        self.restores += 1

    def release(self, slot: int) -> None:
        """A pending or attached slot is free again."""
        if self._lru.pop(slot, 0) is None:
            self.block_of[slot] = -1
        self.used_tokens -= self.tokens[slot]
        self.tokens[slot] = 0
        self._free.append(slot)


class SwapSpace:
    """Blocks of the host-memory KV offload buffer (``cpu_offload_space``): a plain free list."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
