"""The engine thread: drains the inbox, schedules, runs the model, hands out results.

``step()`` reads as the pipeline::

    schedule (with its grammar bitmask) -> runner.execute (launch) -> runner.finish (the one sync)
        -> update_from_output -> deliver

Only this thread touches the scheduler, the runner and the requests' mutable state. Callers
talk to it through :meth:`EngineCore.add`, :meth:`cancel` and :meth:`call` (the inbox) and
receive results through the ``deliver`` callback, which gets one list of
:class:`acb.core.messages.Delivery` per step. What is not the loop lives beside it: the pause and
sleep holds (:class:`acb.core.holds.Holds`), what callers receive
(:class:`acb.core.deliveries.DeliveryBuilder`), the ends of requests outside a step's output
(:class:`acb.core.endings.Endings`), structured outputs' masks
(:class:`acb.core.grammar_masks.GrammarMasks`, which the scheduler calls), the bans the sampler
applies (:meth:`acb.sampling_params.SamplingParams.never_sampled`), the weight swap (the runner's
``swap_weights``) and the step timing (:mod:`acb.core.step_timing`).
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from acb.core.deliveries import DeliveryBuilder
from acb.core.endings import Endings
from acb.core.grammar_masks import GrammarMasks, GrammarSupport
from acb.core.holds import PAUSE_MODES, Holds, PauseState
from acb.core.messages import (
    Add,
    Call,
    Cancel,
    Command,
    Delivery,
    EngineRequest,
    EngineStats,
    LaunchedStep,
    Pause,
    ResetPrefix,
    Resume,
    Runner,
    Sleep,
    Stop,
    Wake,
)
from acb.core.request import Request
from acb.core.request_builder import build_request
from acb.core.scheduler import Scheduler
from acb.core.step_timing import StepTimer, Stopwatch
from acb.core.wire import from_wire, to_wire
from acb.errors import EngineDeadError, EngineNotRunningError
from acb.outputs import RequestStatus

__all__ = ["EngineCore", "StepSyncLike", "scored_rows_for"]

if TYPE_CHECKING:
    from acb.text import TokenizerLike

logger = logging.getLogger(__name__)

_FAILED = object()  # _launch: the step raised and its requests were failed
# the float32 logits of the rows scored in one step (prompt logprobs, scoring requests) stay
# within this: 223 rows of a 150k vocabulary, 1,024 of a 32k one (the log-softmax is one more)
SCORED_LOGITS_BYTES = 128 * 2**20


def scored_rows_for(vocab_size: int) -> int:
    """Rows of logits a step may compute for scoring, for this vocabulary (at least 16)."""
    return max(16, SCORED_LOGITS_BYTES // (4 * max(vocab_size, 1)))


def settle(fut: Future, fn: Callable[[], Any]) -> bool:
    """Run ``fn`` for a command's Future, unless its caller cancelled it: the Future gets its
    result or its exception. True if it ran and returned."""
    if not fut.set_running_or_notify_cancel():
        return False
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001
        fut.set_exception(exc)
        return False
    fut.set_result(result)
    return True


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
        self.grammar = GrammarMasks(grammars)  # structured outputs (the scheduler fills the masks)
        self.scheduler = Scheduler.from_config(
            cfg, max_scored_rows=scored_rows_for(runner.vocab_size), grammar=self.grammar
        )
        self.pool = self.scheduler.pool
        self._deliver = deliver
        self.sync = sync
        self.tokenizer = tokenizer
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
        release = release_id or (lambda request_id: None)
        self.outputs = DeliveryBuilder(release)  # what callers receive
        self.endings = Endings(  # how requests end outside a step's output
            self.scheduler,
            self.holds,
            self.outputs,
            deliver=deliver,
            on_dequeued=self._on_dequeued,
            changed=self._publish_stats,
            release_id=release,
            lockstep=sync is not None,
        )
        self.dead_error: BaseException | None = None
        self.stats = EngineStats(kv_blocks_total=self.pool.num_usable)
        self._generated = 0
        self.on_exit: Callable[[], None] | None = None  # run on the engine thread as it exits
        self.timer = StepTimer()
        self.timing = self.timer.times  # host seconds per phase (StepTimes)

    @property
    def step_log(self) -> list[tuple] | None:
        """Per completed step, when set to a list: (seqs, tokens, decode tokens, schedule, stage,
        compute, process, completed at) (:mod:`acb.core.step_timing`)."""
        return self.timer.log

    @step_log.setter
    def step_log(self, log: list[tuple] | None) -> None:
        self.timer.log = log

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
                    self.endings.cancel_all()
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
            adds = [c.req for c in self._inbox if isinstance(c, Add)]
            self._inbox.clear()
            self.endings.never_ran(adds, self.dead_error)
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
                req = build_request(er, self.tokenizer, self.grammar.compiler_for(er))
                if self.weight_version != 0:
                    for member in req.group.members if req.group is not None else (req,):
                        member.versions = [(self.weight_version, 0)]
                if self._stopping and not self._drain_on_stop:
                    self.endings.unscheduled(req, RequestStatus.CANCELLED)
                    return False
                if not self.holds.hold(req):
                    self.scheduler.add(req)
                return True
            case Cancel(request_id):
                return self.endings.cancel(request_id)
            case Call(fn, fut):
                settle(fut, lambda: fn(self))
                return False
            case Pause(mode, fut):
                return self.holds.pause(mode, fut, stopping=self._stopping, quiesce=self._quiesce)
            case Resume(fut):
                return self.holds.resume(fut)
            case ResetPrefix(fut, weights):
                return settle(fut, lambda: self._reset_for(weights))
            case Sleep(fut):
                return settle(fut, self.sleep)
            case Wake(fut):
                return settle(fut, self.wake_up)
            case Stop(drain):
                self._stopping = True
                self._drain_on_stop = drain
                if self.runner_asleep() and drain and self.scheduler.has_work():
                    self.runner.wake_up()  # a draining stop runs what is left
                if self.holds.state is not PauseState.RUNNING:  # drained or cancelled: nothing stays parked
                    self.holds.leave()
                return True
        raise ValueError(f"unknown engine command {cmd!r}")

    def _reset_for(self, weights: bool) -> int:
        """:meth:`reset_prefix_cache`, counted in ``weight_resets`` when the weights changed."""
        n = self.reset_prefix_cache()
        self.weight_resets += weights
        return n

    # ---------------------------------------------------------- pause, sleep
    def _quiesce(self, cancel: bool) -> None:
        """Before an immediate pause: complete the step in flight; cancel every live request
        when ``cancel``."""
        self._flush_inflight()
        if cancel:
            self.endings.cancel_all()

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
        self.runner.wake_up()
        self._publish_stats()

    def step(self) -> None:
        """One engine step: schedule, run, record, deliver.

        With async batching the step launched here is completed in the next call, after the
        following step has been scheduled and launched (its decode inputs taken on the device
        from this one's samples), so scheduling overlaps the device's work.
        """
        launched = self._launch()
        if launched is None and self._inflight is None:
            raise RuntimeError(
                f"scheduler made no progress with {len(self.scheduler.running)} running and "
                f"{len(self.scheduler.waiting)} waiting requests ({self.pool.num_free} free blocks)"
            )
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

    def _launch(self) -> LaunchedStep | object | None:
        """Schedule a step and launch it on the runner: the launched step, None when nothing could
        be scheduled, or ``_FAILED`` when launching raised (its requests are failed)."""
        with Stopwatch() as scheduling:
            if self.sync is None and self.scheduler.waiting and self.pool.enable_caching:
                self._check_weights()  # (under tensor parallelism the leader checks, in _drain_inbox)
            sched = self.scheduler.schedule()  # (its grammar bitmask filled: structured outputs)
            if sched is not None and sched.newly_admitted:
                self._on_dequeued(len(sched.newly_admitted))
        if sched is None:
            return None
        with Stopwatch() as launching:
            try:
                handle = self.runner.execute(sched)
            except Exception as exc:  # noqa: BLE001 - fail only this step's requests
                self.endings.fail_step(sched, exc)
                return _FAILED
        return LaunchedStep(sched, handle, scheduling.seconds, self.runner.last_stage_s, launching.seconds)

    def _complete(self, launched: LaunchedStep) -> None:
        """Read a launched step's samples (the sync), record them, deliver."""
        sched = launched.sched
        with Stopwatch() as reading:
            try:
                result = self.runner.finish(launched.handle)
            except Exception as exc:  # noqa: BLE001
                self.endings.fail_step(sched, exc)
                return
        with Stopwatch() as processing:
            if result.prompt:
                for rows, (values, tops) in zip(sched.prompt_lp, result.prompt):
                    rows.req.add_prompt_logprobs(rows.first, values, tops)
            if result.next:
                for nrows, (values, top) in zip(sched.next_lp, result.next):
                    nrows.req.out.next_lps, nrows.req.out.next_top = values, top
            progressed, _ = self.scheduler.update_from_output(sched, result.sampled, result.logprobs, result.top)
            items, recorded = self.outputs.step(progressed, sched.scored)
            self._generated += recorded
        self.timer.record(launched, reading.seconds, processing.seconds, processing.end)
        self._publish_stats()  # before delivering: a caller holding every result sees them counted
        if items:
            self._deliver(items)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine is dying: every live, held and queued request gets a FAILED outcome."""
        with self._lock:  # the adds still in the inbox end here (add() posts under this lock)
            adds = [c.req for c in self._inbox if isinstance(c, Add)]
            keep = [c for c in self._inbox if not isinstance(c, Add)]
            self._inbox.clear()
            self._inbox.extend(keep)
        self.endings.engine_died(exc, adds)

    def _publish_stats(self) -> None:
        """A new snapshot: the scheduler's counters and gauges, and the engine's own."""
        self.stats = EngineStats(
            **self.scheduler.gauges(),
            **self.timer.stats(),
            generated_tokens=self._generated,
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
        self.runner.swap_weights(staged)
        self.weight_version = version
        for req in (*self.scheduler.live.values(), *self.holds.held):
            req.new_weights(version)
        forgotten = self._reset_for(weights=True)
        logger.info("weights updated to version %r; %d cached prefix blocks forgotten", version, forgotten)
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
