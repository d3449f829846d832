"""The engine thread: drains the inbox, schedules, runs the model, hands out results.

``step()`` reads as the pipeline::

    schedule -> runner.execute (launch) -> runner.finish (the one sync) -> update_from_output -> deliver

Only this thread touches the scheduler, the runner and the requests' mutable state. Callers
talk to it through :meth:`EngineCore.add`, :meth:`cancel` and :meth:`call` (the inbox) and
receive results through the ``deliver`` callback, which gets one list of
:class:`acb.core.messages.Delivery` per step. The pause and sleep holds are
:class:`acb.core.holds.Holds`; what callers receive is built by
:class:`acb.core.deliveries.DeliveryBuilder`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from acb.core.block_pool import BlockPool, SwapSpace
from acb.core.deliveries import DeliveryBuilder
from acb.core.holds import PAUSE_MODES, Holds, PauseState
from acb.core.messages import (
    Add,
    Call,
    Cancel,
    Command,
    Delivery,
    EngineRequest,
    EngineStats,
    GrammarMask,
    GrammarSupport,
    LaunchedStep,
    Pause,
    ResetPrefix,
    Resume,
    Runner,
    SchedulerOutput,
    Sleep,
    StepTimes,
    Stop,
    Wake,
)
from acb.core.request import Request, build_request
from acb.core.scheduler import Scheduler
from acb.core.wire import from_wire, to_wire
from acb.errors import EngineDeadError, EngineNotRunningError
from acb.outputs import FailureKind, FinishReason, RequestStatus

__all__ = ["EngineCore", "StepSyncLike", "scored_rows_for"]

if TYPE_CHECKING:
    from acb.text import TokenizerLike

logger = logging.getLogger(__name__)

_FAILED = object()  # _launch: the step raised and its requests were failed
# the float32 logits of the rows scored in one step (prompt logprobs, scoring requests) stay
# within this: 223 rows of a 150k vocabulary, 1,024 of a 32k one (the log-softmax is one more)
SCORED_LOGITS_BYTES = 128 * 2**20


def _never_sampled(req: Request, gen_idx: int) -> Collection[int]:
    """The tokens the processors after the grammar's mask never let ``req`` sample as its
    ``gen_idx``-th generated token: the stop tokens ``min_new_tokens`` still holds back, and
    those with a ``-inf`` logit bias (the sampler's rules, in plain Python)."""
    params = req.params
    held: Collection[int] = ()
    if params.min_new_tokens and gen_idx < params.min_new_tokens and req.stop_token_ids:
        held = req.stop_token_ids
    if params.logit_bias:
        banned = [t for t, b in params.logit_bias.items() if b == -math.inf]
        if banned:
            held = {*held, *banned}
    return held


def scored_rows_for(vocab_size: int) -> int:
    """Rows of logits a step may compute for scoring, for this vocabulary (at least 16)."""
    return max(16, SCORED_LOGITS_BYTES // (4 * max(vocab_size, 1)))


HEARTBEAT_S = 1.0  # an idle tensor-parallel leader's broadcast period


class StepSyncLike(Protocol):
    is_leader: bool
    rank: int
    leader_rank: int

    def exchange(self, cmds: list[tuple] | None) -> list[tuple]: ...


class EngineCore:
    def __init__(
        self,
        runner: Runner,
        *,
        deliver: Callable[[list[Delivery]], None],
        release_id: Callable[[str], None] | None = None,
        on_dequeued: Callable[[int], None] | None = None,
        sync: StepSyncLike | None = None,
        tokenizer: TokenizerLike | None = None,
        grammars: Callable[[], GrammarSupport] | None = None,
    ) -> None:
        """Sizes and policies come from ``runner.cfg`` (the runner resolved them on the device).
        ``sync``: the tensor-parallel command broadcast (:mod:`acb.runner.tp_sync`), when the
        model is sharded over several ranks. ``tokenizer``: decodes the text of requests with
        stop strings (the only text decoded on the engine thread). ``release_id``: gives a request's
        id back to the API's registry once its final output is built. ``grammars``: builds (once) the
        grammar compiler of structured outputs, asked for when the first constrained request comes."""
        cfg = runner.cfg
        self.weight_resets = 0  # times the prefix cache was dropped because the weights changed
        self.runner = runner
        self.pool = BlockPool(
            cfg.num_blocks,
            enable_caching=cfg.prefix_caching,
            snapshot_slots=cfg.state_snapshots,
            snapshot_tokens=cfg.snapshot_tokens,
        )
        self.scheduler = Scheduler(
            self.pool,
            block_size=cfg.block_size,
            max_batch_tokens=cfg.max_batch_tokens,
            max_running=cfg.max_requests_per_batch,
            policy=cfg.scheduler_type,
            safety_margin=cfg.safety_margin,
            swap=SwapSpace(cfg.num_swap_blocks) if cfg.num_swap_blocks else None,
            host_rows=SwapSpace(cfg.state_host_rows) if cfg.state_host_rows else None,
            resume_max_tail=cfg.state_resume_max_tail,
            max_scored_rows=scored_rows_for(runner.vocab_size),
            whole_prefill=cfg.whole_prefill,
        )
        self._deliver = deliver
        self.sync = sync
        self.tokenizer = tokenizer
        self._grammar_factory = grammars
        self._grammars: GrammarSupport | None = None  # set by the first constrained request
        self.async_batching = cfg.async_batching
        self._inflight: LaunchedStep | None = None  # async batching: the launched step not yet completed
        self._on_dequeued = on_dequeued or (lambda n: None)
        self._inbox: deque[Command] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.weight_version: Any = 0  # the version of the weights steps run with (swap_weights)
        self._closed = False  # set (under _lock) as the thread exits; adds are refused after
        self._drain_on_stop = False
        # the caller's pause and sleep: two holds that compose (their contract: acb.core.holds)
        self.holds: Holds[Request] = Holds(
            asleep=self.runner_asleep, release=self.scheduler.add, changed=self._publish_stats
        )
        self._release_id = release_id or (lambda request_id: None)
        self.outputs = DeliveryBuilder(self._release_id)  # what callers receive
        self.dead_error: BaseException | None = None
        self.stats = EngineStats(kv_blocks_total=self.pool.num_usable)
        self._generated = 0
        self.on_exit: Callable[[], None] | None = None  # run on the engine thread as it exits
        self.timing = StepTimes()  # host seconds per phase
        # per-step (seqs, tokens, decode tokens, schedule, stage, compute, process, completed at) when enabled
        self.step_log: list[tuple] | None = None

    # ------------------------------------------------------------ callers
    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="acb-engine", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread (None before ``start``)."""
        return self._thread

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def check_alive(self) -> None:
        """Raises:
        EngineDeadError: the engine thread died (the cause is chained).
        EngineNotRunningError: it was not started, or stops.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine died: {self.dead_error!r}") from self.dead_error
        if not self.is_running or self._stopping:
            raise EngineNotRunningError("the engine is not running (start it, or use it as a context manager)")

    def add(self, req: EngineRequest) -> None:
        """Post a validated request to the engine thread (its ids already claimed).

        Args:
            req: the request.

        Raises:
            EngineNotRunningError: the engine thread has exited.
        """
        with self._lock:
            if self._closed:
                raise EngineNotRunningError("the engine has stopped")
            self._post(Add(req))

    def cancel(self, request_id: str) -> None:
        """Post a cancel: the request (all its samples) ends CANCELLED, if still live.

        Args:
            request_id: the request's id.
        """
        self._post(Cancel(request_id))

    def call(self, fn: Callable[[EngineCore], Any]) -> Future:
        """Run ``fn(core)`` on the engine thread between steps; returns its Future."""
        fut: Future = Future()
        self._post(Call(fn, fut))
        return fut

    def pause(self, mode: str = "wait") -> Future:
        """Stop running steps; the Future completes once paused. ``mode``: ``"wait"`` lets the
        live requests finish first (requests submitted meanwhile wait for :meth:`resume`),
        ``"cancel"`` cancels them, ``"keep"`` parks them where they are (they continue on resume)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        fut: Future = Future()
        self._post(Pause(mode, fut))
        return fut

    def resume(self) -> Future:
        """Run steps again after :meth:`pause` (the Future completes once resumed)."""
        fut: Future = Future()
        self._post(Resume(fut))
        return fut

    def command(self, kind: str) -> Future:
        """Post ``"reset_prefix"``, ``"sleep"`` or ``"wake"``; the Future gets the result."""
        fut: Future = Future()
        commands = {"reset_prefix": ResetPrefix, "sleep": Sleep, "wake": Wake}
        if kind not in commands:
            raise ValueError(f"unknown engine command {kind!r}; expected one of {', '.join(commands)}")
        self._post(commands[kind](fut))
        return fut

    @property
    def paused(self) -> bool:
        """Whether steps are held back: paused, draining for a pause, or asleep."""
        return self.holds.paused

    def stop(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the thread. ``drain``: finish live requests first; otherwise cancel them."""
        if self._thread is None:
            return
        self._post(Stop(drain))
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to exit."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _post(self, cmd: Command) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    # ------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                self._drain_inbox()
                if self._stopping and (not self._drain_on_stop or not self.scheduler.has_work()):
                    self._flush_inflight()
                    self._cancel_all()
                    break
                if not self.holds.may_step() or not self.scheduler.has_work():
                    if self._flush_inflight():
                        continue
                    self.holds.drained(self.scheduler.has_work())
                    if not self._wake.is_set():
                        self.runner.idle()
                    if self.sync is None:
                        self._wake.wait()
                    elif self.sync.is_leader:  # an empty frame now and then: the followers see it is alive
                        self._wake.wait(HEARTBEAT_S)
                    # (a follower waits in the next iteration's broadcast instead)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as exc:  # noqa: BLE001 - the engine must never die silently
            self.dead_error = exc
            logger.error("acb engine thread died:\n%s", traceback.format_exc())
            self._fail_all(exc)
        finally:
            self._stopping = True
            with self._lock:
                self._closed = True
            self.holds.close()
            leftover = [build_request(c.req, None, runs=False) for c in self._inbox if isinstance(c, Add)]
            self._inbox.clear()
            for req in leftover:
                if self.dead_error is None:
                    self._end_unscheduled(req, RequestStatus.CANCELLED)
                else:
                    req.error = f"the engine died: {self.dead_error!r}"
                    req.failure = FailureKind.ENGINE_DEAD
                    self._end_unscheduled(req, RequestStatus.FAILED)
            if self.on_exit is not None:
                try:
                    self.on_exit()
                except Exception:  # noqa: BLE001
                    logger.exception("error while shutting the engine down")

    def _drain_inbox(self) -> None:
        """Apply the callers' commands. Under tensor parallelism the leader then sends the ones it
        applied to the other ranks, which apply them too (one broadcast per loop iteration)."""
        sync = self.sync
        sent: list[tuple] | None = [] if sync is not None and sync.is_leader else None
        inbox = self._inbox
        while inbox:
            cmd = inbox.popleft()
            if self._apply(cmd) and sent is not None:
                sent.append(to_wire(cmd))
        if sync is None:
            return
        if sent is not None and self.scheduler.waiting and self.pool.enable_caching:
            # the leader alone decides when the weights changed, so that every rank forgets its
            # prefix cache at the same point
            if self.runner.weights_changed():
                self._apply(ResetPrefix(Future(), weights=True))
                sent.append(("reset_prefix",))
        for wire in sync.exchange(sent):
            if sent is None:  # a follower: the leader's commands, in its order
                self._apply(from_wire(wire))

    def _apply(self, cmd: Command) -> bool:
        """Apply one command; True when it changed what the engine runs (and so must be applied
        on every tensor-parallel rank)."""
        match cmd:
            case Add(er):
                if er.params.stop and self.tokenizer is None:  # (a leader refuses them at submit)
                    raise RuntimeError(
                        f"request {er.request_id!r} has stop strings, and this tensor-parallel rank's "
                        "engine has no tokenizer to match them in lock step: give every rank's "
                        "engine the tokenizer"
                    )
                if er.params.structured_outputs is not None and self._grammars is None:
                    if self._grammar_factory is None:
                        raise RuntimeError("a request has structured outputs and this engine has no grammar compiler")
                    self._grammars = self._grammar_factory()
                req = build_request(er, self.tokenizer, self._grammars)
                if self.weight_version != 0:
                    for member in req.group.members if req.group is not None else (req,):
                        member.versions = [(self.weight_version, 0)]
                if self._stopping and not self._drain_on_stop:
                    self._end_unscheduled(req, RequestStatus.CANCELLED)
                    return False
                if not self.holds.hold(req):
                    self.scheduler.add(req)
                return True
            case Cancel(request_id):
                return self._cancel(request_id)
            case Call(fn, fut):
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self))
                    except BaseException as exc:  # noqa: BLE001
                        fut.set_exception(exc)
                return False
            case Pause(mode, fut):
                return self.holds.pause(mode, fut, stopping=self._stopping, quiesce=self._quiesce)
            case Resume(fut):
                return self.holds.resume(fut)
            case ResetPrefix(fut, weights):
                return self._settle(fut, lambda: self._reset_for(weights))
            case Sleep(fut):
                return self._settle(fut, self.sleep)
            case Wake(fut):
                return self._settle(fut, self.wake_up)
            case Stop(drain):
                self._stopping = True
                self._drain_on_stop = drain
                if self.runner_asleep() and drain and self.scheduler.has_work():
                    self._wake_runner()  # a draining stop runs what is left
                if (
                    self.holds.state is not PauseState.RUNNING
                ):  # a stop ends a pause: drained or cancelled, nothing stays parked
                    self.holds.leave()
                return True
        raise ValueError(f"unknown engine command {cmd!r}")

    def _settle(self, fut: Future, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` for a command's Future (unless its caller cancelled it); True if it ran."""
        if not fut.set_running_or_notify_cancel():
            return False
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001
            fut.set_exception(exc)
            return False
        fut.set_result(result)
        return True

    def _reset_for(self, weights: bool) -> int:
        """:meth:`reset_prefix_cache`, counted in ``weight_resets`` when the weights changed."""
        n = self.reset_prefix_cache()
        self.weight_resets += weights
        return n

    def _cancel(self, request_id: str) -> bool:
        head = self.scheduler.live.get(request_id)
        if head is None:
            held = self.holds.unhold(lambda r: r.request_id == request_id)
            if held is None:
                return False
            held.finish_reason = FinishReason.CANCELLED
            self._end_unscheduled(held, RequestStatus.CANCELLED)
            return True
        never_scheduled = head.first_scheduled_time is None
        members = head.group.members if head.group is not None else [head]
        ended = []
        for req in members:
            if self.scheduler.cancel(req.request_id) is not None:
                req.finish_reason = FinishReason.CANCELLED
                ended.append(req)
        if never_scheduled:
            self._on_dequeued(1)
        self._publish_stats()
        self._deliver_final(ended)
        return True

    # ---------------------------------------------------------- pause, sleep
    def _quiesce(self, cancel: bool) -> None:
        """Before an immediate pause: complete the step in flight; cancel every live request
        when ``cancel``."""
        self._flush_inflight()
        if cancel:
            self._cancel_all()

    def runner_asleep(self) -> bool:
        """Whether the runner sleeps (freed its cache and buffers: no steps run)."""
        return self.runner.asleep

    def sleep(self) -> Any:
        """(Engine thread.) Hold the steps, take every running request off the device (recomputed
        after waking), forget the prefix cache and free the runner's cache and buffers; returns
        what the runner freed. The pause state is left as it is: :meth:`wake_up` gives it back."""
        if self.runner_asleep():
            return self.runner.sleep()  # nothing more to free
        self._flush_inflight()
        self.scheduler.preempt_all()
        self.scheduler.kv.reset_prefix_cache()
        released = self.runner.sleep()  # frees the packed linears too
        self._publish_stats()
        return released

    def wake_up(self) -> None:
        """(Engine thread.) Allocate what :meth:`sleep` freed; steps run again unless a pause
        holds them (an explicit pause stays, a drain goes on)."""
        if not self.runner_asleep():
            return
        self._wake_runner()
        self._publish_stats()

    def _wake_runner(self) -> None:
        self.runner.wake_up()

    def step(self) -> None:
        """One engine step: schedule, run, record, deliver.

        With async batching the step launched here is completed in the next call, after the
        following step has been scheduled and launched (its decode inputs taken on the device
        from this one's samples), so scheduling overlaps the device's work.
        """
        launched = self._launch()
        if launched is None and self._inflight is None:
            self._no_progress()
        if launched is _FAILED:  # its requests were failed; the engine carries on
            launched = None
        assert launched is None or isinstance(launched, LaunchedStep)
        if self.async_batching:
            prev, self._inflight = self._inflight, launched
        else:
            prev = launched
        if prev is not None:
            self._complete(prev)

    def _flush_inflight(self) -> bool:
        """Complete the launched step, if any (async batching); True if there was one."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return False
        self._complete(prev)
        return True

    def _no_progress(self) -> None:
        raise RuntimeError(
            f"scheduler made no progress with {len(self.scheduler.running)} running and "
            f"{len(self.scheduler.waiting)} waiting requests ({self.pool.num_free} free blocks)"
        )

    def _launch(self) -> LaunchedStep | object | None:
        """Schedule a step and launch it on the runner: the launched step, None when nothing could
        be scheduled, or ``_FAILED`` when launching raised (its requests are failed)."""
        t0 = time.perf_counter()
        if self.sync is None and self.scheduler.waiting and self.scheduler.kv.pool.enable_caching:
            self._check_weights()  # (under tensor parallelism the leader checks, in _drain_inbox)
        sched = self.scheduler.schedule()
        if sched is None:
            return None
        if sched.newly_admitted:
            self._on_dequeued(len(sched.newly_admitted))
        if self._grammars is not None:  # (an engine that never saw structured outputs skips this)
            self._fill_grammar_masks(sched)
        t1 = time.perf_counter()
        try:
            handle = self.runner.execute(sched)
        except Exception as exc:  # noqa: BLE001 - fail only this step's requests
            self._fail_step(sched, exc)
            return _FAILED
        t2 = time.perf_counter()
        return LaunchedStep(sched, handle, t1 - t0, self.runner.last_stage_s, t2 - t1)

    def _fill_grammar_masks(self, sched: SchedulerOutput) -> None:
        """Structured outputs: each constrained sample's row of the step's token bitmask, from its
        matcher (up to date: a constrained request is never scheduled with a token in flight)."""
        reqs = sched.sample_reqs
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return
        assert self._grammars is not None
        bitmask = self._grammars.bitmask(len(reqs))
        for i in rows:
            reqs[i].matcher.fill_mask(bitmask, i)
        # a row whose grammar allows nothing the sampler may pick is a dead end: its request ends
        # when this step's token comes back (which is not recorded); dead_ends unmasks its row, so
        # that no row of the step is all -inf
        excluded = [_never_sampled(reqs[i], sched.sample_gen_idx[i]) for i in rows]
        for i in self._grammars.dead_ends(bitmask, rows, excluded):
            reqs[i].dead_end = True
        sched.grammar = GrammarMask(bitmask, rows)

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> None:
        if self.sync is not None:
            # the ranks' collectives are out of step once one rank's step failed: nothing can
            # carry on, so the engine dies (every handle fails) on every rank
            raise exc
        logger.error("step %d failed; failing its %d requests", sched.step_id, sched.num_seqs, exc_info=exc)
        msg = f"{type(exc).__name__}: {exc}"
        self.scheduler.abandon_step(sched.step_id)
        failed = [r for r in sched.requests if not r.status.is_terminal]
        for req in failed:
            self.scheduler.fail(req, msg)
        for req in sched.sample_reqs:
            req.in_flight = max(0, req.in_flight - 1)
        self._publish_stats()
        self._deliver_final(failed)

    def _complete(self, launched: LaunchedStep) -> None:
        """Read a launched step's samples (the sync), record them, deliver."""
        sched, handle = launched.sched, launched.handle
        t_sched, t_stage, t_launch = launched.schedule_s, launched.stage_s, launched.launch_s
        t2 = time.perf_counter()
        try:
            result = self.runner.finish(handle)
        except Exception as exc:  # noqa: BLE001
            self._fail_step(sched, exc)
            return
        t3 = time.perf_counter()
        if result.prompt:
            for rows, (values, tops) in zip(sched.prompt_lp, result.prompt):
                rows.req.add_prompt_logprobs(rows.first, values, tops)
        if result.next:
            for nrows, (values, top) in zip(sched.next_lp, result.next):
                nrows.req.out.next_lps, nrows.req.out.next_top = values, top
        progressed, _ = self.scheduler.update_from_output(sched, result.sampled, result.logprobs, result.top)
        items, recorded = self.outputs.step(progressed, sched.scored)
        self._generated += recorded
        t4 = time.perf_counter()
        # host time per phase; "stage" is the runner's input preparation inside execute
        tm = self.timing
        tm.schedule += t_sched
        tm.stage += t_stage
        tm.compute += (t_launch - t_stage) + (t3 - t2)
        tm.process += t4 - t3
        if self.step_log is not None:
            self.step_log.append(
                (
                    sched.num_seqs,
                    sched.num_tokens,
                    sched.num_decode_tokens,
                    t_sched,
                    t_stage,
                    t_launch - t_stage + (t3 - t2),
                    t4 - t3,
                    t4,
                )
            )
        self._publish_stats()  # before delivering: a caller holding every result sees them counted
        if items:
            self._deliver(items)

    def _deliver_final(self, reqs: list[Request]) -> None:
        items = self.outputs.finals(reqs)
        if items:
            self._deliver(items)

    def _end_unscheduled(self, req: Request, status: RequestStatus) -> None:
        """End a request that never reached the scheduler (all its samples, for n > 1)."""
        members = req.group.members if req.group is not None else [req]
        for m in members:
            m.status = status
            m.error, m.failure = req.error, req.failure
            m.finish_reason = FinishReason.CANCELLED if status == RequestStatus.CANCELLED else FinishReason.ERROR
            m.finish_time = time.perf_counter()
        self._on_dequeued(1)
        self._deliver_final(members)

    def _cancel_all(self) -> None:
        for held in self.holds.take_held():  # added while draining for a pause: never reached the scheduler
            held.finish_reason = FinishReason.CANCELLED
            self._end_unscheduled(held, RequestStatus.CANCELLED)
        reqs = list(self.scheduler.live.values())
        for req in reqs:
            never_scheduled = req.first_scheduled_time is None and req.sample_index == 0
            if self.scheduler.cancel(req.request_id) is not None:
                req.finish_reason = FinishReason.CANCELLED
            if never_scheduled:
                self._on_dequeued(1)
        # adds that arrive after the stop are cancelled by _drain_inbox
        self._publish_stats()
        self._deliver_final(reqs)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine is dying: every live request gets a FAILED outcome. Nothing here may depend on
        what can fail (decoding, a sink's callbacks): each final output falls back to a bare one,
        and each delivery is tried on its own."""
        reqs = list(self.scheduler.live.values())
        with self._lock:  # the adds still in the inbox end here (add() posts under this lock)
            adds = [c.req for c in self._inbox if isinstance(c, Add)]
            keep = [c for c in self._inbox if not isinstance(c, Add)]
            self._inbox.clear()
            self._inbox.extend(keep)
        queued = [build_request(er, None, runs=False) for er in adds] + self.holds.take_held()
        queued_adds = [m for r in queued for m in (r.group.members if r.group is not None else [r])]
        msg = f"the engine died: {type(exc).__name__}: {exc}"
        for req in reqs + queued_adds:
            req.status = RequestStatus.FAILED
            req.finish_reason = FinishReason.ERROR
            req.error, req.failure = msg, FailureKind.ENGINE_DEAD
            req.finish_time = time.perf_counter()
        # a dead engine holds nothing: blocks, rows and ids go back before anyone hears of the death
        # (best effort: the state that killed it may be broken)
        try:
            self.scheduler.release_all()
        except BaseException:  # noqa: BLE001
            logger.exception("could not release the dead engine's KV blocks")
        for req in reqs + queued_adds:
            self._release_id(req.request_id)
        for req in reqs + queued_adds:
            try:
                final = self.outputs.final_of(req)
            except BaseException:  # noqa: BLE001
                logger.exception("could not build the failed output of %r", req.request_id)
                final = self.outputs.dead_output(req, msg)
            if final is None:
                continue
            try:
                self._deliver([Delivery(req.out.key, [], final=final)])
            except BaseException:  # noqa: BLE001
                logger.exception("could not deliver the failure of %r after the engine died", req.request_id)

    def _publish_stats(self) -> None:
        """A new snapshot: the scheduler's counters as they are (same names), and the engine's own."""
        pool, tm = self.pool, self.timing
        self.stats = EngineStats(
            **vars(self.scheduler.stats),  # (flat ints: no asdict's deep copy, every step)
            generated_tokens=self._generated,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_usable,
            kv_blocks_cached=pool.num_cached,
            prefix_evictions=pool.evictions,
            state_snapshots_cached=pool.snapshots.num_attached if pool.snapshots is not None else 0,
            state_snapshot_restores=pool.snapshots.restores if pool.snapshots is not None else 0,
            host_schedule_s=tm.schedule,
            host_stage_s=tm.stage,
            compute_s=tm.compute,
            host_process_s=tm.process,
            paused=self.paused,
            asleep=self.runner_asleep(),
        )

    def _check_weights(self) -> None:
        """Before admitting requests: if the model's weights changed since the cached prefixes were
        computed (an optimizer step, ``load_state_dict``), forget them, so that no request reads
        K/V computed with other weights."""
        if self.runner.weights_changed():
            n = self._reset_for(weights=True)
            if n:
                logger.info("the model's weights changed: %d cached prefix blocks forgotten", n)

    def swap_weights(self, staged: Any, version: Any) -> Any:
        """Swap an update's staged weights in (engine thread, between two steps: through
        :meth:`call`), drop what was computed with the old ones, and give the running requests
        the new version; returns it. ``staged``: :class:`acb.runner.weight_update.Staged`."""
        staged.swap()
        self.weight_version = version
        for req in (*self.scheduler.live.values(), *self.holds.held):
            req.new_weights(version)
        forgotten = self._reset_for(weights=True)
        logger.info(
            "weights updated to version %r (%d tensors, %.1f MiB); %d cached prefix blocks forgotten",
            version,
            len(staged.names),
            staged.nbytes / 2**20,
            forgotten,
        )
        return version

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (engine thread), and whatever else the runner derived from
        the weights (the packed CPU linears, packed again by the next step); returns how many
        blocks were forgotten."""
        self.runner.forget_weights()
        return self.scheduler.kv.reset_prefix_cache()

    # -------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Assert the scheduler's and the block pool's invariants (call it on the engine thread,
        through :meth:`call`, or once the engine has stopped)."""
        self.scheduler.check_invariants()
