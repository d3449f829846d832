"""The KV cache's blocks as the scheduler sees them.

The scheduler decides who runs; :class:`KVManager` owns everything about blocks: which
request holds which device block (``Request.block_ids``, reference-counted in the
:class:`BlockPool`), what is cached under which prefix digest, which host blocks hold
offloaded KV (:class:`SwapSpace`), and the copies the runner must make for all of it
(``SchedulerOutput.block_updates``, ``swap_out``, ``swap_in``, ``block_copies_after``). The
scheduler never touches the pool or the swap space itself.

The contract:

- ``blocks_needed(req, n)``: device blocks ``req`` lacks to compute its next ``n`` tokens,
  counting the copies of the partial prompt block its samples get when they fork in that
  step. ``allocate_slots`` gives them (it must fit: check ``num_free`` first);
  ``take_decode_slot`` is the one-token shortcut, which gives way when no block is free.
- Admission: ``lookup`` finds the longest cached prefix (never the whole prompt: its last
  token is always computed); ``prefix_in_progress`` says whether the next block of that
  prefix is being computed by a step not yet recorded (async batching), so the request can
  wait a step and hit it; ``admission_cost`` is what admitting takes from the free blocks;
  ``admit`` takes the hits, allocates the rest, and plans the swap-in of an offloaded
  request (its host blocks are freed after that step, so no offload in the same step can
  overwrite them first).
- ``fork``: the samples of ``n > 1`` share the parent's full prompt blocks and each gets a
  copy of the partial last block, made after the forward that writes it.
- ``plan_swap_out`` offloads a preempted request's computed KV to host blocks before the
  step's forward (which may reuse its device blocks); ``free`` gives back everything a
  request holds, device and host.
- ``note_computing`` / ``register_computed``: a step's full prompt blocks become findable
  in the prefix cache only once its output is recorded (``begin_step`` / ``end_step`` bracket
  a step's life).
- ``reset_prefix_cache`` starts a new *epoch* (the weights changed): the cache is emptied, and
  KV computed in an older epoch is never registered again. Each request carries the epoch its
  KV belongs to (``Request.kv_epoch``, set when it starts computing from the current cache and
  kept through offload and forks), so a step launched before the reset and recorded after it
  (async batching), or a request that was running across the change, cannot put K/V of the old
  weights, or K/V that attended to it, back in the cache.
- State snapshots (a model with state layers; the pool has a :class:`SnapshotPool`): a prefix
  hit must end at a block that carries a snapshot of the layers' state where it ends, so
  ``lookup`` cuts the cached chain back to its last such block, and ``admit`` plans the
  snapshot's restore into the request's row (``SchedulerOutput.restores``). At admission
  ``plan_snapshots`` picks where the request's prefill will take snapshots, at block
  boundaries only: where its cached chain ended without one (an earlier prompt diverged
  there), where it diverges from the requests queued behind it (an evaluation's shared
  contexts), and, for a request that generates, at its prompt's last full block and the block
  before the last token (the same prompt, or the prompt extended, again) when the prompt is long
  (``SPECULATIVE_MIN_TOKENS``) or ends on a block. ``note_snapshots`` takes a slot for each boundary a
  step crosses (``SchedulerOutput.snapshots``); ``register_computed`` attaches it to the cached
  block once the step's output is recorded (a step that fails gives it back at ``end_step``).
  A request whose prefix another running request will snapshot waits for it, as a paged one
  waits for blocks in progress.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from acb.core.block_pool import BlockPool, SwapSpace, block_digest
from acb.core.request import Request

if TYPE_CHECKING:
    from acb.core.messages import SchedulerOutput

# state layers: a prompt this long or longer is snapshotted at its last full block and the block
# before its last token for its own sake (a snapshot inside a segment costs a call per state layer)
SPECULATIVE_MIN_TOKENS = 256


class KVManager:
    """Device and host KV blocks of the requests, and the copies that move them."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        swap: SwapSpace | None = None,
        host_rows: SwapSpace | None = None,
        resume_max_tail: int = 0,
    ) -> None:
        self.pool = pool
        self.swap = swap
        # state layers: host rows their state is offloaded to with a preempted request's KV (a
        # model with state layers offloads only when it gets one)
        self.host_rows = host_rows
        self._host_rows_to_free: list[int] = []
        # state layers that resume a hit a token at a time (Mamba1): a hit is taken only when at most
        # this many prompt tokens are left after it (past that, recomputing is faster); 0: any hit
        self.resume_max_tail = resume_max_tail
        # the shortest prompt snapshotted on the chance that it comes again (plan_snapshots)
        self.speculative_min_tokens = SPECULATIVE_MIN_TOKENS
        self.block_size = block_size
        self._fork_copies: list[int] = []  # blocks allocated in allocate_slots for the fork that follows
        self._host_to_free: list[int] = []  # host blocks read by the last step's swap-ins
        # step id -> digests of the prompt blocks that step computes, until its output is recorded
        # (with async batching the previous step is still in flight while the next is built)
        self._computing: dict[int, set[bytes]] = {}
        self.epoch = 0  # moves on with every reset_prefix_cache (see the module docstring)
        # state snapshots: digests a running request will snapshot (planned or in a step in flight)
        self._planned: dict[bytes, int] = {}
        # step id -> (slot, digest, request, epoch) of the snapshots that step takes
        self._pending: dict[int, list[tuple[int, bytes, Request, int]]] = {}

    @property
    def snapshots(self) -> bool:
        """Whether prefix hits need a state snapshot (a model with state layers)."""
        return self.pool.snapshots is not None

    # -------------------------------------------------------------- questions
    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def host_blocks_held(self) -> int:
        """Offload blocks held by requests (those read by the last step's swap-ins count as free)."""
        if self.swap is None:
            return 0
        return self.swap.num_blocks - self.swap.num_free - len(self._host_to_free)

    def blocks_needed(self, req: Request, num_new: int) -> int:
        total = req.num_computed_tokens + num_new
        need = -(-total // self.block_size) - len(req.block_ids)
        if req.children and total == req.num_tokens and req.prompt_len % self.block_size:
            # the samples fork in this step: each gets its own copy of the partial last block
            need += sum(1 for c in req.children if not c.status.is_terminal)
        return need

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks for the longest known prefix of ``req`` (at least one token is left to
        compute, so the whole last block is recomputed when the prompt is block-aligned; a request
        that records prompt logprobs from position ``lp_start`` computes that position and on)."""
        if not self.pool.enable_caching:
            return []
        hits = self.pool.lookup(self._digests(req, self._lookup_blocks(req)))
        if self.pool.snapshots is not None:  # a hit ends where a snapshot of the state does
            snap = self.pool.snapshot
            while hits and snap[hits[-1]] < 0:
                hits.pop()
            if hits and self.resume_max_tail and req.num_tokens - len(hits) * self.block_size > self.resume_max_tail:
                return []
        return hits

    def _lookup_blocks(self, req: Request) -> int:
        upto = req.num_tokens - 1 if req.prompt_lps is None else min(req.num_tokens - 1, req.lp_start)
        return upto // self.block_size

    def prefix_in_progress(self, req: Request, hits: list[int]) -> bool:
        """Whether the block after ``req``'s cached prefix is being computed by a step whose output
        is not recorded yet (another request with the same prefix)."""
        hashes = req.block_hashes
        if self.pool.snapshots is not None:  # a snapshot another request will take further along
            planned = self._planned
            if not planned:
                return False
            lo, hi = len(hits), self._lookup_blocks(req)
            if self.resume_max_tail:  # only for a snapshot whose hit it would take
                lo = max(lo, -(-(req.num_tokens - self.resume_max_tail) // self.block_size) - 1)
            return any(d in planned for d in hashes[lo:hi])
        nxt = hashes[len(hits)] if len(hits) < len(hashes) else None
        return nxt is not None and any(nxt in p for p in self._computing.values())

    def admission_cost(self, req: Request, hits: list[int], computed: int, num_new: int) -> int:
        """Free blocks that admitting ``req`` (with ``hits`` cached, ``computed`` tokens known) for
        ``num_new`` tokens uses up; reviving a free cached block uses one too."""
        return self._new_blocks_at(req, hits, computed, num_new) + self.pool.num_free_among(hits)

    # ---------------------------------------------------------------- actions
    def begin_step(self, step_id: int) -> None:
        self._computing[step_id] = set()
        if self._host_to_free:  # read by the previous step's swap-ins, which are ordered before ours
            swap = self.swap
            assert swap is not None  # host blocks exist only with a swap space
            swap.free(self._host_to_free)
            self._host_to_free = []
        if self._host_rows_to_free:
            self.host_rows.free(self._host_rows_to_free)  # type: ignore[union-attr]
            self._host_rows_to_free = []

    def end_step(self, step_id: int) -> None:
        """The step's output was recorded (after ``register_computed``), or it failed, or it ran
        nothing: the snapshot slots it took and did not attach go back."""
        self._computing.pop(step_id, None)
        for slot, digest, _, _ in self._pending.pop(step_id, ()):
            self._unplan(digest)
            self.pool.snapshots.release(slot)  # type: ignore[union-attr]

    def take_decode_slot(self, req: Request, out: SchedulerOutput) -> bool:
        """Room for one more token of ``req`` without taking a block from anyone: a new block when
        the token starts one (the decode hot path: one call per request per step). False if none
        is free."""
        if req.num_computed_tokens % self.block_size:
            return True
        new_block = self.pool.allocate(1)
        if new_block is None:
            return False
        out.block_updates.append((req.row, len(req.block_ids), new_block))
        req.block_ids.extend(new_block)
        return True

    def allocate_slots(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        """Give ``req`` the blocks it needs for ``num_new`` tokens (they must fit)."""
        need = self.blocks_needed(req, num_new)
        if need > 0:
            blocks = self.pool.allocate(need)
            assert blocks is not None, f"{req}: {need} blocks do not fit"
            self._take_blocks(out, req, num_new, blocks)

    def admit(self, req: Request, hits: list[int], computed: int, num_new: int, out: SchedulerOutput) -> int:
        """Give an admitted request (which has its row) its cached prefix and new blocks, and plan
        the swap-in of an offloaded one. Returns the number of host blocks swapped in."""
        need = self._new_blocks_at(req, hits, computed, num_new)
        self.pool.take(hits)
        blocks = self.pool.allocate(need)
        assert blocks is not None
        swapped_in = 0
        if req.swapped is None:  # computed from the current cache (offloaded KV keeps its epoch)
            req.kv_epoch = self.epoch
        else:
            host, _, host_row = req.swapped
            out.swap_in.extend(zip(host, blocks[: len(host)]))
            if host_row >= 0:  # its state layers' state, read back into its row
                out.row_swap_in.append((host_row, req.row))
                self._host_rows_to_free.append(host_row)
            swapped_in = len(host)
            # freed after this step, so no swap-out in this step can overwrite them first
            self._host_to_free.extend(host)
            req.swapped = None
        req.block_ids = list(hits)
        req.num_computed_tokens = computed
        req.num_registered = len(hits)
        if hits:
            out.block_updates.append((req.row, 0, list(hits)))
            snaps = self.pool.snapshots
            if snaps is not None:  # the state where the hit ends, into the request's row
                slot = self.pool.snapshot[hits[-1]]
                snaps.touch(slot)
                out.restores.append((slot, req.row))
        self._take_blocks(out, req, num_new, blocks)
        return swapped_in

    def fork(self, parent: Request, child: Request, out: SchedulerOutput) -> None:
        """One sample of ``parent`` (whose prompt this step computes) starts from its KV."""
        bs = self.block_size
        full = parent.prompt_len // bs
        shared = parent.block_ids[:full]
        self.pool.incref(shared)
        child.block_ids = list(shared)
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered = min(parent.num_registered, full)
        child.kv_epoch = parent.kv_epoch
        if parent.prompt_len % bs:
            dst = self._fork_copies.pop()
            out.block_copies_after.append((parent.block_ids[full], dst))
            child.block_ids.append(dst)
        out.block_updates.append((child.row, 0, list(child.block_ids)))

    def end_fork(self) -> None:
        assert not self._fork_copies, "fork copy blocks left over"

    def plan_swap_out(self, req: Request, out: SchedulerOutput) -> tuple[list[int], int, int] | None:
        """Offload ``req``'s computed KV to host blocks (and, for a model with state layers, its
        row of state to a host row) when there is room (copied before this step's forward, which
        may reuse them). Returns ``(host blocks, tokens, host row or -1)`` to keep in
        ``req.swapped`` once its device blocks are freed, or None (it will be recomputed)."""
        n = -(-req.num_computed_tokens // self.block_size)
        if self.swap is None or not n:
            return None
        host_row = -1
        if self.host_rows is not None:
            got = self.host_rows.allocate(1)
            if got is None:
                return None
            host_row = got[0]
        host = self.swap.allocate(n)
        if host is None:
            if host_row >= 0:
                self.host_rows.free([host_row])  # type: ignore[union-attr]
            return None
        out.swap_out.extend(zip(req.block_ids[:n], host))
        if host_row >= 0:
            out.row_swap_out.append((req.row, host_row))
        return host, req.num_computed_tokens, host_row

    def free(self, req: Request) -> None:
        """Give back every block ``req`` holds, device and host (and the snapshots it planned)."""
        if req.snap_plan:
            for _, digest in req.snap_plan:
                self._unplan(digest)
            req.snap_plan = []
        if req.swapped is not None:
            swap = self.swap
            assert swap is not None  # a request is swapped out only into the swap space
            swap.free(req.swapped[0])
            if req.swapped[2] >= 0:
                self.host_rows.free([req.swapped[2]])  # type: ignore[union-attr]
            req.swapped = None
        if req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []

    def note_computing(self, step_id: int, req: Request, start: int, num_new: int) -> None:
        """Full prompt blocks this step computes: same-prefix requests wait for them."""
        if self.pool.enable_caching and start < req.prompt_len and req.kv_epoch == self.epoch:
            full = (start + num_new) // self.block_size
            if full > start // self.block_size:
                self._computing[step_id].update(self._digests(req, full)[start // self.block_size :])

    def register_computed(self, out: SchedulerOutput) -> None:
        """The step's output is recorded: its full blocks become findable in the prefix cache (a
        later step may already be scheduled, with async batching), with the snapshots it took."""
        if not self.pool.enable_caching:
            return
        bs, epoch = self.block_size, self.epoch
        for req, start, n in zip(out.requests, out.start_pos, out.num_new):
            upto = min(start + n, len(req.token_ids)) // bs
            if upto > req.num_registered and not req.status.is_terminal and req.kv_epoch == epoch:
                self._register(req, upto)
        pending = self._pending.pop(out.step_id, None)
        if pending:
            pool = self.pool
            for slot, digest, req, at in pending:
                self._unplan(digest)
                if at != epoch or req.status.is_terminal or not pool.attach_snapshot(digest, slot):
                    pool.snapshots.release(slot)  # type: ignore[union-attr]

    # -------------------------------------------------------------- snapshots
    def plan_snapshots(self, req: Request, hits: int, peers: Iterable[Request]) -> None:
        """Where the prefill of ``req`` (admitted with ``hits`` cached blocks, a snapshot at the
        last) takes snapshots of its state (see the module docstring); ``peers``: the requests
        queued behind it."""
        bs = self.block_size
        prompt_blocks = req.prompt_len // bs
        if prompt_blocks <= hits or req.kv_epoch != self.epoch:
            return
        digests = self._digests(req, prompt_blocks)
        # the prompt again, or extended (a chat's next turn): its last full block and the block
        # before its last token. A snapshot inside a segment costs the state layers one more call
        # (measured: 40% of a Mamba2 batch of 64-256-token prompts; 5% of Qwen3-Next's at 200-1,000
        # tokens), so on that chance only for a prompt of SPECULATIVE_MIN_TOKENS or more (a long
        # prefix is what a hit saves most of), or where it costs nothing (the prompt ends on a
        # block); never for scoring (an evaluation's windows and contexts: their shared contexts
        # are forks or the junctions below)
        ends = set()
        if not req.scoring and req.prompt_lps is None:
            if prompt_blocks * bs == req.prompt_len:
                ends.add(prompt_blocks)
            if req.prompt_len >= self.speculative_min_tokens:
                ends |= {prompt_blocks, self._lookup_blocks(req)}
        chain = len(self.pool.lookup(digests))
        ends.add(chain)  # the cached chain ends here without a snapshot
        for peer in peers:  # where the requests behind it part from it
            theirs = self._digests(peer, min(self._lookup_blocks(peer), prompt_blocks))
            same = 0
            while same < len(theirs) and theirs[same] == digests[same]:
                same += 1
            ends.add(same)
        snap, cached = self.pool.snapshot, self.pool.cached
        plan = []
        for end in sorted(e for e in ends if hits < e <= prompt_blocks):
            digest = digests[end - 1]
            b = cached.get(digest)
            if b is not None and snap[b] >= 0:
                continue  # taken already (by a request that diverged later)
            plan.append((end * bs, digest))
            self._planned[digest] = self._planned.get(digest, 0) + 1
        req.snap_plan = plan

    def note_snapshots(self, out: SchedulerOutput, req: Request, start: int, end: int) -> None:
        """The snapshots of ``req``'s plan that this step's tokens ``[start, end)`` reach: each gets
        a slot (the least recently used one's when none is free; none at all: skipped)."""
        plan = req.snap_plan
        while plan and plan[0][0] <= end:
            pos, digest = plan.pop(0)
            slot = self.pool.take_snapshot_slot(pos) if pos > start else None
            if slot is None:
                self._unplan(digest)
                continue
            out.snapshots.append((req.row, pos - start, slot))
            self._pending.setdefault(out.step_id, []).append((slot, digest, req, req.kv_epoch))

    def _unplan(self, digest: bytes) -> None:
        n = self._planned[digest] - 1
        if n:
            self._planned[digest] = n
        else:
            del self._planned[digest]

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix and start a new epoch; returns how many blocks were forgotten."""
        self.epoch += 1
        self._computing = {step: set() for step in self._computing}  # nothing in flight will be registered
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ checks
    def check(self, running: list[Request], waiting: Iterable[Request], idle: bool) -> None:
        """Assert the pool's invariants; each block's reference count equals the running requests
        holding it; a running request holds the blocks of its computed tokens; a queued one holds
        none; idle means no block (device or host) held."""
        self.pool.check()
        holders: dict[int, int] = {}
        for r in running:
            assert len(r.block_ids) * self.block_size >= r.num_computed_tokens, f"{r}: too few blocks"
            for b in r.block_ids:
                holders[b] = holders.get(b, 0) + 1
        for b in range(1, self.pool.num_blocks):
            rc = self.pool.ref_counts[b]
            assert rc == holders.get(b, 0), f"block {b}: ref count {rc}, held by {holders.get(b, 0)} requests"
        for r in waiting:
            assert not r.block_ids, f"{r} is queued but holds blocks"
            assert not r.snap_plan, f"{r} is queued but plans snapshots"
        snaps = self.pool.snapshots
        if snaps is not None:
            pending = sum(len(p) for p in self._pending.values())
            assert snaps.num_free + snaps.num_attached + pending == snaps.num_slots, "snapshot slots leaked"
        if idle:
            assert not self._planned and not any(self._pending.values()), "snapshots planned with no live request"
            assert self.pool.num_used == 0, f"{self.pool.num_used} KV blocks leaked with no live request"
            held = self.host_blocks_held
            assert held == 0, f"{held} offload blocks leaked with no live request"
            rows = self.host_rows
            if rows is not None:
                held = rows.num_blocks - rows.num_free - len(self._host_rows_to_free)
                assert held == 0, f"{held} host rows of state leaked with no live request"

    # ---------------------------------------------------------------- helpers
    def _new_blocks_at(self, req: Request, hits: list[int], computed: int, num_new: int) -> int:
        """``blocks_needed`` of a queued request as if it held ``hits`` and had ``computed`` tokens."""
        req.num_computed_tokens, req.block_ids = computed, hits  # provisional
        need = self.blocks_needed(req, num_new)
        req.num_computed_tokens, req.block_ids = 0, []
        return need

    def _take_blocks(self, out: SchedulerOutput, req: Request, num_new: int, blocks: list[int]) -> None:
        """Give ``req`` the blocks it needs for ``num_new`` tokens; extras are fork copies (n > 1)."""
        own = -(-(req.num_computed_tokens + num_new) // self.block_size) - len(req.block_ids)
        first_col = len(req.block_ids)
        req.block_ids.extend(blocks[:own])
        out.block_updates.append((req.row, first_col, blocks[:own]))
        self._fork_copies = blocks[own:]

    def _digests(self, req: Request, num_blocks: int) -> list[bytes]:
        """The request's first ``num_blocks`` block digests (computed once per block)."""
        hashes = req.block_hashes
        bs = self.block_size
        toks = req.token_ids
        images = req.media
        while len(hashes) < num_blocks:
            b = len(hashes)
            salt = req.cache_salt
            if images is not None and (b + 1) * bs > images.first:  # a block from the first image token on
                salt += images.key
            hashes.append(block_digest(hashes[-1] if hashes else b"", toks[b * bs : (b + 1) * bs], salt))
        return hashes[:num_blocks]

    def _register(self, req: Request, full: int) -> None:
        """Make the request's first ``full`` blocks (computed) findable in the prefix cache."""
        if full <= req.num_registered or full > len(req.block_ids):
            return
        digests = self._digests(req, full)
        register = self.pool.register
        for b in range(req.num_registered, full):
            register(req.block_ids[b], digests[b])
        req.num_registered = full
