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

Invariants (checked by :meth:`BlockPool.check`):

- every usable block is either free (ref count 0, in the free queue once) or referenced;
- ``num_free + num_used == num_usable``;
- the digest map and the per-block digests agree.
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

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
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
        """Forget every digest (blocks in use stay in use); returns how many were forgotten."""
        n = len(self.cached)
        for b in self.cached.values():
            self.digests[b] = None
        self.cached.clear()
        return n

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
