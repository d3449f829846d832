"""Which requests run in the next step, and how many of their tokens.

The contract, in one place:

- ``schedule()`` returns a :class:`SchedulerOutput` for one step, or ``None`` when nothing
  can run. At most ``max_batch_tokens`` query tokens and ``max_running`` sequences per step.
  Each scheduled sequence contributes ``num_new`` consecutive tokens starting at its
  ``num_computed_tokens``; a long prompt is split over several steps (chunked prefill).
  ``num_computed_tokens`` is advanced here, at schedule time.
- A sequence *samples* in a step when the step computes its last known token; the sampled
  token is recorded by ``update_from_output``.
- Policies: ``fifo`` serves running requests first (decodes and unfinished prefills, oldest
  first), then admits waiting requests in arrival order with the budget left.
  ``prefill_first`` continues unfinished prefills, then admits waiting requests (keeping back
  the blocks running decodes need), then runs decodes with the budget left.
- Admission is in order and keeps ``safety_margin`` of the blocks free. One exception: a
  request whose next prefix block is being computed by another request's step (not recorded
  yet) waits that step out to hit it in the cache rather than compute it twice; the requests
  behind it are admitted meanwhile, and it keeps its place at the head of the queue.
- Scoring requests (``Request.scoring``) end with their prompt: the step that completes it
  records their scored rows (``prompt_lp``, ``next_lp``), forks a scoring group's children,
  and samples nothing. A step's scored rows stay within ``max_scored_rows``.
- Preemption: when a running request needs a block and none is free, the newest running
  request that is not in this step yet is preempted: its blocks are freed (its KV offloaded
  to host memory first when there is room), its generated tokens kept, and it goes to the
  front of the queue. The oldest running request is therefore never preempted while others
  run, and since every admitted request fits the cache on its own (checked at submit, for
  all ``n`` samples at their fork), progress is guaranteed. Never chosen: a sample forked in
  this step (it is in the step through its parent's logits row), and, with async batching,
  a request whose last token is in flight (it frees its blocks when that token lands; if
  nobody else can give way, the request that needs the block waits a step).
- Async batching: a request preempted while a token of it is in flight stays ``PENDING`` in
  the queue when the token lands (and finishes there if it was its last); it is re-admitted
  only once nothing of it is in flight.
- A step that schedules nothing returns ``None``, but what it decided (rows freed, KV
  offloads) goes out with the next step that runs, before anything can reuse those blocks.
- Structured outputs: the output carries the step's grammar bitmask (``SchedulerOutput.grammar``),
  filled last by :class:`acb.core.grammar_masks.GrammarMasks` from the constrained samples'
  matchers; an engine that never saw a constrained request skips it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from acb.core.block_pool import BlockPool, SwapSpace
from acb.core.grammar_masks import GrammarMasks
from acb.core.kv_manager import KVManager
from acb.core.messages import NextRows, PromptRows, SchedulerOutput
from acb.core.request import Request
from acb.outputs import FailureKind, FinishReason, RequestStatus

if TYPE_CHECKING:
    from acb.config import ResolvedConfig

__all__ = ["Scheduler", "SchedulerStats"]

# state layers: how many queued requests an admitted one compares its prompt with, to snapshot
# its state where they part (their shared context is then computed once)
SNAPSHOT_PEERS = 8


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    cancelled: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hits: int = 0  # of which found cached
    swapped_out_blocks: int = 0  # KV blocks offloaded to host memory at preemption
    swapped_out_rows: int = 0  # rows of state layers' state offloaded with them
    swapped_in_blocks: int = 0
    recomputed_preemptions: int = 0  # preemptions that dropped the KV (no offload space)
    failed: int = 0  # requests failed inside a step (the engine's own death is not counted)


class Scheduler:
    """Owns the waiting queue, the running list and the block pool's use."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        max_batch_tokens: int,
        max_running: int,
        policy: str = "fifo",
        safety_margin: float = 0.0,
        swap: SwapSpace | None = None,
        host_rows: SwapSpace | None = None,
        resume_max_tail: int = 0,
        fast_decode: bool = True,
        max_scored_rows: int = 1024,
        whole_prefill: bool = False,
        grammar: GrammarMasks | None = None,
    ) -> None:
        if policy not in ("fifo", "prefill_first"):
            raise ValueError(f"unknown scheduler policy {policy!r}")
        self.pool = pool  # read-only here (stats, tests): blocks are the KV manager's business
        self.kv = KVManager(pool, block_size, swap, host_rows, resume_max_tail)
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.policy = policy
        self.watermark_blocks = int(safety_margin * pool.num_usable)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}
        self._free_rows = list(range(max_running - 1, -1, -1))
        self._freed_rows: list[int] = []
        self._swap_out_carry: list[tuple[int, int]] = []  # offloads decided by a step that ran nothing
        self._row_swap_out_carry: list[tuple[int, int]] = []  # (and state rows' offloads)
        # plain decodes take a shortcut past _schedule_tokens; False sends them the general way
        # (the tests check both give the same SchedulerOutput)
        self.fast_decode = fast_decode
        # prompts are prefilled in one step (a model whose state layers cannot resume a prefill):
        # a request is admitted only when its whole prompt fits the step's budget, or alone in an
        # empty step, whatever its length
        self.whole_prefill = whole_prefill
        self.max_scored_rows = max_scored_rows
        self.grammar = grammar  # structured outputs: fills each step's token bitmask
        self._step_id = 0
        self.stats = SchedulerStats()

    @classmethod
    def from_config(cls, cfg: ResolvedConfig, *, max_scored_rows: int, grammar: GrammarMasks | None) -> Scheduler:
        """The engine's scheduler over a fresh block pool, both set up by the resolved config.

        Args:
            cfg: the sizes and policies the engine runs with (``Runner.cfg``).
            max_scored_rows: rows of logits a step may compute for scoring.
            grammar: structured outputs' masks (filled at the end of each :meth:`schedule`).
        """
        pool = BlockPool(
            cfg.num_blocks,
            enable_caching=cfg.prefix_caching,
            snapshot_slots=cfg.state_snapshots,
            snapshot_tokens=cfg.snapshot_tokens,
        )
        return cls(
            pool,
            block_size=cfg.block_size,
            max_batch_tokens=cfg.max_batch_tokens,
            max_running=cfg.max_requests_per_batch,
            policy=cfg.scheduler_type,
            safety_margin=cfg.safety_margin,
            swap=SwapSpace(cfg.num_swap_blocks) if cfg.num_swap_blocks else None,
            host_rows=SwapSpace(cfg.state_host_rows) if cfg.state_host_rows else None,
            resume_max_tail=cfg.state_resume_max_tail,
            max_scored_rows=max_scored_rows,
            whole_prefill=cfg.whole_prefill,
            grammar=grammar,
        )

    def gauges(self) -> dict[str, Any]:
        """Its counters (:class:`SchedulerStats`, same names) and gauges as they are now, under the
        names of :class:`acb.core.messages.EngineStats`."""
        pool = self.pool
        snaps = pool.snapshots
        return {
            **vars(self.stats),  # (flat ints: no asdict's deep copy, every step)
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": pool.num_used,
            "kv_blocks_total": pool.num_usable,
            "kv_blocks_cached": pool.num_cached,
            "prefix_evictions": pool.evictions,
            "state_snapshots_cached": snaps.num_attached if snaps is not None else 0,
            "state_snapshot_restores": snaps.restores if snaps is not None else 0,
        }

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Queue a request (and register the samples that will fork from it, for n > 1)."""
        for r in [req, *(req.children or ())]:
            assert r.request_id not in self.live, f"duplicate live request {r.request_id}"
            self.live[r.request_id] = r
        self.waiting.append(req)

    @property
    def host_blocks_held(self) -> int:
        """Offload blocks held by requests (those read by the last step's swap-ins count as free)."""
        return self.kv.host_blocks_held

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, request_id: str) -> Request | None:
        """Remove a live request and free its blocks, its finish reason CANCELLED (and that of its
        samples not yet forked, which end with it); ``None`` if it is not live."""
        req = self.live.get(request_id)
        if req is None:
            return None
        req.finish_reason = FinishReason.CANCELLED
        self._finish(req, RequestStatus.CANCELLED)
        self.stats.cancelled += 1
        return req

    def release_all(self) -> None:
        """Drop every live request without an outcome (the engine died; they were failed already)
        and give back what they held."""
        for req in list(self.live.values()):
            self._release(req)
        self.running.clear()
        self.waiting.clear()
        self.live.clear()

    def abandon_step(self, step_id: int) -> None:
        """A step failed: nothing it computed will be recorded."""
        self.kv.end_step(step_id)

    def fail(self, req: Request, error: str) -> None:
        req.error = error
        req.failure = FailureKind.REQUEST
        req.finish_reason = FinishReason.ERROR
        self._finish(req, RequestStatus.FAILED)
        self.stats.failed += 1

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req.status == RequestStatus.PENDING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass  # a sample of n > 1 that has not forked yet
        self._release(req)
        req.status = status
        req.finish_time = time.perf_counter()
        del self.live[req.request_id]
        if req.children:  # samples that would have forked from this one end with it
            for child in req.children:
                if not child.status.is_terminal:
                    child.error, child.failure = req.error, req.failure
                    child.finish_reason = req.finish_reason
                    self._finish(child, status)
            req.children = None

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        if req.row >= 0:
            self._free_rows.append(req.row)
            self._freed_rows.append(req.row)
            req.row = -1

    def preempt_all(self) -> int:
        """Take every running request off the device to be recomputed later (its tokens kept),
        as ``sleep`` needs; no step may be in flight. Returns how many were preempted."""
        victims = self.running[::-1]
        for req in victims:  # the last admitted first: appendleft keeps the queue's order
            self._preempt(req, None)
        return len(victims)

    def _preempt(self, req: Request, out: SchedulerOutput | None) -> None:
        """Take ``req`` off the device: offload its KV to host memory when there is room and a
        step to carry the copy (it resumes where it was), else drop it (it is recomputed, its
        tokens kept)."""
        self.running.remove(req)
        swapped = self.kv.plan_swap_out(req, out) if out is not None else None
        if swapped is not None:
            self.stats.swapped_out_blocks += len(swapped[0])
            self.stats.swapped_out_rows += swapped[2] >= 0
        else:
            self.stats.recomputed_preemptions += 1
        self._release(req)
        req.swapped = swapped
        req.num_computed_tokens = 0
        req.num_registered = 0
        req.status = RequestStatus.PENDING
        req.num_preemptions += 1
        if req.events is None:
            req.events = []
        req.events.append(("preempted", time.perf_counter()))
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def check_invariants(self) -> None:
        """Assert the bookkeeping's invariants: the KV manager's (blocks, reference counts, host
        blocks, nothing held when idle), and a queued request holds no row."""
        self.kv.check(self.running, self.waiting, idle=not self.has_work())
        for r in self.waiting:
            assert r.row < 0, f"{r} is queued but holds a row"

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput | None:
        self.kv.begin_step(self._step_id)
        out = SchedulerOutput(
            step_id=self._step_id,
            requests=[],
            rows=[],
            num_new=[],
            start_pos=[],
            input_ids=[],
            sample_idx=[],
            sample_reqs=[],
            sample_rows=[],
            sample_gen_idx=[],
            block_updates=[],
            newly_admitted=[],
            row_inits=[],
            freed_rows=self._freed_rows,
            block_copies_after=[],
            swap_out=self._swap_out_carry,
            swap_in=[],
        )
        out.row_swap_out = self._row_swap_out_carry
        self._freed_rows, self._swap_out_carry, self._row_swap_out_carry = [], [], []
        budget = self.max_batch_tokens
        if self.policy == "fifo":
            budget, preempted = self._schedule_running(out, budget, self.running)
            if not preempted:
                budget = self._admit(out, budget, reserve=0)
        else:  # prefill_first
            prefilling = [r for r in self.running if r.num_tokens + r.in_flight - r.num_computed_tokens > 1]
            decoding = [r for r in self.running if r.num_tokens + r.in_flight - r.num_computed_tokens == 1]
            budget, preempted = self._schedule_running(out, budget, prefilling)
            if not preempted:
                reserve = sum(1 for r in decoding if self.kv.blocks_needed(r, 1) > 0)
                budget = self._admit(out, budget, reserve=reserve)
            decoding = [r for r in decoding if r.row >= 0]  # some may have been preempted
            budget, _ = self._schedule_running(out, budget, decoding)
        if not out.requests:
            # nothing runs, but rows freed and KV offloads decided here must reach the runner
            # before the blocks are reused: they go with the next step that runs
            self._freed_rows = out.freed_rows + self._freed_rows
            self._swap_out_carry = out.swap_out
            self._row_swap_out_carry = out.row_swap_out
            self.kv.end_step(self._step_id)
            return None
        self._step_id += 1
        st = self.stats
        st.steps += 1
        st.prefill_tokens += out.num_prefill_tokens
        st.decode_tokens += out.num_decode_tokens
        grammar = self.grammar
        if grammar is not None and grammar.compiler is not None:  # (no constrained request yet: nothing to fill)
            grammar.fill(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, candidates: list[Request]) -> tuple[int, bool]:
        """Schedule ``candidates`` (running requests, in order); preempt the newest when blocks run out."""
        preempted_any = False
        scheduled = {id(r) for r in out.requests}
        kv = self.kv
        fast = self.fast_decode
        # decode fast path: one token, at most one new block, no fork; appended straight to the lists
        requests, rows, num_new_l, start_pos = out.requests, out.rows, out.num_new, out.start_pos
        input_ids, sample_idx, sample_reqs = out.input_ids, out.sample_idx, out.sample_reqs
        sample_rows, sample_gen = out.sample_rows, out.sample_gen_idx
        for req in list(candidates):
            if budget <= 0:
                break
            if req.row < 0:  # preempted earlier in this loop
                continue
            computed = req.num_computed_tokens
            toks = req.token_ids
            in_flight = req.in_flight
            if in_flight and len(toks) - req.prompt_len + in_flight >= req.max_new_tokens:
                continue  # its last token is in flight: it finishes when that arrives
            if in_flight and req.matcher is not None:
                continue  # structured outputs: its next mask needs the token in flight
            todo = len(toks) + in_flight - computed
            if fast and todo == 1 and computed >= req.prompt_len and not req.children and kv.take_decode_slot(req, out):
                i = len(requests)
                requests.append(req)
                rows.append(req.row)
                num_new_l.append(1)
                start_pos.append(computed)
                if computed < len(toks):
                    input_ids.append(toks[computed])
                else:  # the token sampled by the step in flight
                    out.placeholders.append((len(input_ids), self._placeholder_src(out, req)))
                    input_ids.append(0)
                req.num_computed_tokens = computed + 1
                req.in_flight += 1
                req.last_sample = (out.step_id, len(sample_reqs))
                sample_idx.append(i)
                sample_reqs.append(req)
                sample_rows.append(req.row)
                sample_gen.append(computed + 1 - req.prompt_len)
                out.num_decode_tokens += 1
                scheduled.add(id(req))
                budget -= 1
                continue
            num_new = min(todo, budget)
            if req.prompt_lps is not None:
                num_new = self._cap_scored(out, req, computed, num_new)
            if req.media is not None:
                num_new = self._whole_spans(req, computed, num_new)
            if num_new <= 0:
                continue
            need = kv.blocks_needed(req, num_new)
            while need > kv.num_free:
                # the newest running request not yet in this step, except those whose last token is
                # in flight (async batching): they give their blocks back when it arrives
                # (a sample forked in this step is in it too, through its parent's row of logits)
                victim = next(
                    (
                        r
                        for r in reversed(self.running)
                        if id(r) not in scheduled
                        and r.last_sample[0] != out.step_id
                        and not self._last_token_in_flight(r)
                    ),
                    None,
                )
                if victim is None:
                    break
                self._preempt(victim, out)
                preempted_any = True
                if victim is req:
                    break
            if req.row < 0 or need > kv.num_free:
                continue  # preempted, or waiting for the blocks of requests about to finish
            kv.allocate_slots(req, num_new, out)
            self._schedule_tokens(out, req, num_new)
            scheduled.add(id(req))
            budget -= num_new
        return budget, preempted_any

    @staticmethod
    def _whole_spans(req: Request, computed: int, num_new: int) -> int:
        """A prefill chunk never ends inside an image whose tokens attend to each other both ways
        (Gemma 3): it stops before the image, or, starting at or in it, takes the rest of it
        (past the step's budget if it must, as a whole prefill does)."""
        assert req.media is not None
        end = computed + num_new
        for a, b in req.media.spans:
            if a < end < b:
                return a - computed if a > computed else b - computed
        return num_new

    @staticmethod
    def _last_token_in_flight(req: Request) -> bool:
        # (inlined in _schedule_running's loop, the hot path)
        return bool(req.in_flight) and req.num_generated + req.in_flight >= req.max_new_tokens

    def _admit(self, out: SchedulerOutput, budget: int, reserve: int) -> int:
        """Admit waiting requests in order while budget, rows and blocks last."""
        # requests waiting one step for a prefix block another request's step is computing: set
        # aside (the ones behind them are admitted meanwhile), back at the head of the queue after
        skipped: list[Request] = []
        now = None
        while self.waiting and budget > 0 and self._free_rows:
            req = self.waiting[0]
            # the samples of n > 1 hold their rows from admission, so that they can always fork
            rowless = [c for c in req.children or () if c.row < 0 and not c.status.is_terminal]
            if len(rowless) + 1 > len(self._free_rows) or req.in_flight:
                break  # (a preempted request waits for its in-flight token before it resumes)
            kv = self.kv
            hits: list[int]
            if req.swapped is not None:  # resume from host memory: no prefix lookup, no recompute
                hits, computed = [], req.swapped[1]
            else:  # (prompt logprobs: the cache is read for the positions before lp_start only)
                hits = kv.lookup(req)
                computed = len(hits) * self.block_size
                if kv.prefix_in_progress(req, hits):
                    # its next block is being computed by another request's step: wait one step and
                    # hit it, rather than computing the same prefix twice (the requests behind it
                    # go on being admitted: an evaluation's contexts come in groups sharing a prefix)
                    skipped.append(self.waiting.popleft())
                    continue
            todo = req.num_tokens - computed
            if self.whole_prefill and todo > budget:
                if out.requests and todo > self.max_batch_tokens:
                    break  # a prompt longer than a step: next step, alone
                # whole: past the budget by at most this step's decodes (or, alone, by its length)
                budget = todo
            num_new = self._cap_scored(out, req, computed, min(todo, budget))
            if req.media is not None:
                num_new = self._whole_spans(req, computed, num_new)
            if num_new <= 0:
                break  # this step's rows of logits for scoring are taken: next step
            need_free = kv.admission_cost(req, hits, computed, num_new)
            if need_free > kv.num_free - self.watermark_blocks - reserve:
                # an empty engine must still make progress whatever the margin
                if self.running or out.requests or need_free > kv.num_free - reserve:
                    break
            resumed = req.swapped is not None
            self.waiting.popleft()
            req.row = self._free_rows.pop()
            for c in rowless:
                c.row = self._free_rows.pop()
            swapped_in = kv.admit(req, hits, computed, num_new, out)
            if kv.snapshots and not resumed:  # where its prefill snapshots its state layers
                kv.plan_snapshots(req, len(hits), itertools.islice(self.waiting, SNAPSHOT_PEERS))
            if req.num_preemptions and req.events is not None:
                req.events.append(("resumed", time.perf_counter()))
            if resumed:
                self.stats.swapped_in_blocks += swapped_in
            else:
                self.stats.prefix_queries += req.num_tokens
                self.stats.prefix_hits += computed
                if req.first_scheduled_time is None:
                    req.num_cached_tokens = computed
            req.status = RequestStatus.PREFILLING
            self.running.append(req)
            out.row_inits.append(req)
            if req.first_scheduled_time is None:
                now = time.perf_counter() if now is None else now
                req.first_scheduled_time = now
                out.newly_admitted.append(req)
            self._schedule_tokens(out, req, num_new)
            budget -= num_new
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        return budget

    def _schedule_tokens(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        self.kv.note_computing(out.step_id, req, start, num_new)
        out.requests.append(req)
        out.rows.append(req.row)
        out.num_new.append(num_new)
        out.start_pos.append(start)
        end = start + num_new
        known = len(req.token_ids)
        if req.prompt_lps is not None:  # positions whose next token is a prompt token, not yet done
            lo, hi = max(start, req.lp_start + len(req.prompt_lps)), min(end, req.prompt_len - 1)
            if hi > lo:
                out.prompt_lp.append(
                    PromptRows(req, lo, hi - lo, len(out.input_ids) + lo - start, req.token_ids[lo + 1 : hi + 1])
                )
                out.scored_rows += hi - lo
        out.input_ids.extend(req.token_ids[start : min(end, known)])
        if end > known:  # the one token sampled by the step in flight (async batching)
            assert end == known + 1 and req.in_flight == 1, f"{req}: {end - known} unknown tokens"
            out.placeholders.append((len(out.input_ids), self._placeholder_src(out, req)))
            out.input_ids.append(0)
        req.num_computed_tokens = end
        if req.snap_plan:
            self.kv.note_snapshots(out, req, start, end)
        if req.scoring and end == known:  # its prompt is done: it ends with this step, sampling nothing
            req.in_flight += 1  # (so that nothing schedules it again meanwhile)
            out.scored.append(req)
            if req.score_next:
                out.next_lp.append(NextRows(req, len(out.input_ids) - 1, req.score_next))
                out.scored_rows += 1
            if req.children:  # a scoring group's children start from its KV (their own tokens next)
                self._fork(out, req, -1)
        elif end == known + req.in_flight:
            i = len(out.requests) - 1
            self._add_sample(out, req, i, end - req.prompt_len)
            if req.children:
                self._fork(out, req, i)
        if num_new == 1 and start >= req.prompt_len:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

    def _cap_scored(self, out: SchedulerOutput, req: Request, start: int, num_new: int) -> int:
        """``num_new`` cut so that the step's rows of logits for prompt logprobs stay within
        ``max_scored_rows`` (each row is vocabulary-sized: a 4,000-token context scored at once
        would be a [4000, vocab] tensor)."""
        if req.prompt_lps is None:
            return num_new
        first = max(start, req.lp_start + len(req.prompt_lps))  # the first position that needs a row
        last = min(start + num_new, req.prompt_len - 1)
        rows = max(0, last - first) + (1 if req.score_next and start + num_new >= req.prompt_len else 0)
        room = self.max_scored_rows - out.scored_rows
        if rows <= room:
            return num_new
        # up to the first scored position, then as many rows as there is room for (the row after
        # the whole prompt, when cut off, comes in a later step of its own)
        return max(first - start, 0) + max(room, 0) if room > 0 else max(first - start, 0)

    def _add_sample(self, out: SchedulerOutput, req: Request, logits_i: int, gen_idx: int) -> None:
        req.in_flight += 1
        req.last_sample = (out.step_id, len(out.sample_reqs))
        out.sample_idx.append(logits_i)
        out.sample_reqs.append(req)
        out.sample_rows.append(req.row)
        out.sample_gen_idx.append(gen_idx)

    @staticmethod
    def _placeholder_src(out: SchedulerOutput, req: Request) -> int:
        step, k = req.last_sample
        assert step == out.step_id - 1, f"{req}: its in-flight token is not from the previous step"
        return k

    def _fork(self, out: SchedulerOutput, parent: Request, logits_i: int) -> None:
        """n > 1: the parent's prompt is computed in this step; its samples start from it.

        They share the parent's full prompt blocks (ref counts) and each gets a copy of the
        partial last block, made after this step's forward writes it. Each draws its first
        token from the parent's logits, with its own random stream. A scoring group's children
        (prompts that extend the parent's) fork the same way and then compute their own tokens.
        """
        children = parent.children
        assert children is not None  # only a parent of n > 1 samples forks
        for child in children:
            if child.status.is_terminal:
                continue
            self.kv.fork(parent, child, out)
            out.state_copies_after.append((parent.row, child.row))
            child.num_computed_tokens = parent.prompt_len
            child.status = RequestStatus.PREFILLING
            child.first_scheduled_time = parent.first_scheduled_time
            self.running.append(child)
            out.row_inits.append(child)
            if not child.scoring:  # (a scoring child computes its own tokens from the next step on)
                self._add_sample(out, child, logits_i, 0)
        self.kv.end_fork()
        parent.children = None

    # ----------------------------------------------------------------- update
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: list[int],
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """Record each sample's token. Returns (requests that got a token, finished ones).

        Finished requests have left the running list and their blocks are free when this returns.
        """
        now = time.perf_counter()
        self.kv.register_computed(out)
        self.kv.end_step(out.step_id)
        progressed: list[Request] = []
        finished: list[Request] = []
        for k, req in enumerate(out.sample_reqs):
            req.in_flight -= 1
            if req.status.is_terminal:  # cancelled while its step was in flight
                continue
            want = req.want_logprobs
            try:
                done = req.append_token(
                    sampled[k],
                    logprobs[k] if want and logprobs is not None else None,
                    now,
                    top[k][: req.params.logprobs] if want and top is not None else None,
                )
            except Exception as exc:  # noqa: BLE001 - a user-supplied stop check (its tokenizer) raised
                self.fail(req, f"{type(exc).__name__} in the output checks (stop strings, grammar): {exc}")
                progressed.append(req)
                continue
            if req.status != RequestStatus.PENDING:  # (preempted while this token was in flight: it waits)
                req.status = RequestStatus.DECODING
            progressed.append(req)
            if done:
                self._finish(req, RequestStatus.FINISHED)
                self.stats.finished += 1
                finished.append(req)
        for req in out.scored:  # scoring requests end with their prompt (nothing is sampled)
            req.in_flight -= 1
            if req.status.is_terminal:
                continue
            req.finish_reason = FinishReason.LENGTH
            self._finish(req, RequestStatus.FINISHED)
            self.stats.finished += 1
            finished.append(req)
        return progressed, finished
