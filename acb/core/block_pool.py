"""KV-cache blocks: reference counts and a free queue.

Block 0 is reserved as scratch: padded rows write there and nothing reads it, so it is
never handed out. Invariants (checked by :meth:`BlockPool.check`):

- every usable block is either free (ref count 0, in the free queue once) or referenced;
- ``num_free + num_used == num_usable``.
"""

from __future__ import annotations

from collections import deque

SCRATCH_BLOCK = 0


class BlockPool:
    """Hands out KV blocks all-or-nothing and takes them back by reference count."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ref count 1, or ``None`` (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pop = self._free.popleft
        out = [pop() for _ in range(n)]
        rc = self.ref_counts
        for b in out:
            rc[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        rc = self.ref_counts
        for b in blocks:
            assert rc[b] > 0, f"incref of free block {b}"
            rc[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free queue."""
        rc = self.ref_counts
        push = self._free.append
        for b in blocks:
            assert rc[b] > 0, f"double free of block {b}"
            rc[b] -= 1
            if rc[b] == 0:
                push(b)

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every engine test)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        assert SCRATCH_BLOCK not in free, "the scratch block is in the free queue"
        for b in range(1, self.num_blocks):
            rc = self.ref_counts[b]
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (rc == 0) == (b in free), f"block {b}: ref count {rc} but free={b in free}"
