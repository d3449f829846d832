"""The sinks that carry results from the engine thread to callers, and :func:`deliver`.

The engine thread hands each step's results to :func:`deliver` as one list. Results for
requests awaited on an event loop are posted to each request's :class:`AsyncSink` (in the
engine's order) and the loops are called with **one** thread-safe, non-blocking call per loop
per step; on the loop, the sink appends what was posted to what its consumer has not read yet,
so a slow consumer gets several steps coalesced into one delta. Requests consumed from plain threads use :class:`ThreadSink` (a
``threading.Condition``; no event loop needed).

Text is decoded in one place per request: here, on the consumer's side, by an
:class:`acb.text.IncrementalDetokenizer` per sample; or, for requests with stop strings (which
must be matched on the text as it grows), on the engine thread, whose deliveries then carry the
text pieces (``Delivery.text``) and whose outputs carry the text. Never both.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from acb.api.loops import current_loop, wake, wake_threadsafe
from acb.core.messages import Delivery
from acb.errors import EngineDeadError, RequestFailedError
from acb.outputs import FailureKind, GenerationOutput, RequestStatus, StreamDelta
from acb.telemetry import RequestTrace
from acb.telemetry import end as end_trace
from acb.text import IncrementalDetokenizer

logger = logging.getLogger(__name__)


def _error_of(out: GenerationOutput) -> Exception | None:
    if out.status != RequestStatus.FAILED:
        return None
    msg = out.error or "request failed"
    if out.failure == FailureKind.ENGINE_DEAD:
        return EngineDeadError(f"request {out.request_id!r}: {msg}")
    return RequestFailedError(f"request {out.request_id!r} failed: {msg}", out)


# ---------------------------------------------------------------- event loops
# A consumer's event loop, whichever anyio backend runs it: an asyncio loop itself, or the
# _TrioLoop of a trio run. Both have ``call_soon_threadsafe(fn, *args)`` (callable from any
# thread, never blocks, raises RuntimeError once that loop is gone) and ``create_future()`` (a
# one-shot waiter: ``await fut`` until ``fut.set_result(None)`` on that loop).


WAIT = object()  # poll(): nothing new yet
_NO_TOKENS = Delivery(-1, [])


class _Unread:
    """What one sample's consumer has not read yet: steps coalesce here when it is slow."""

    __slots__ = ("token_ids", "logprobs", "top", "text")

    def __init__(self, d: Delivery) -> None:
        self.token_ids = list(d.token_ids)
        self.logprobs = None if d.logprobs is None else list(d.logprobs)
        self.top = None if d.top is None else list(d.top)
        self.text: str | None = None

    def add_text(self, piece: str) -> None:
        self.text = piece if self.text is None else self.text + piece

    def extend(self, d: Delivery) -> None:
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.top is not None:
            self.top = (self.top or []) + d.top


class _SinkState:
    """Tokens not yet read by the consumer (per sample, for n > 1), and the final output once known."""

    __slots__ = ("request_id", "unread", "final", "stream_done", "detokenizers", "trace", "streamed")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # per sample, characters of text delivered so far by the engine thread (stop strings)
        self.streamed: dict[int, int] = {}
        self.unread: dict[int, _Unread] = {}  # sample index -> what its consumer has not read
        self.final: GenerationOutput | None = None
        self.stream_done = False  # the final delta (or the failure) was handed out
        # one per sample when the engine has a tokenizer: the text of the stream and the output
        self.detokenizers: list[IncrementalDetokenizer] | None = None
        self.trace: RequestTrace | None = None  # for its span and metrics, recorded when it ends

    def add(self, d: Delivery) -> None:
        if d.token_ids:
            slot = self.unread.get(d.sample_index)
            if slot is None:
                slot = self.unread[d.sample_index] = _Unread(d)
            else:
                slot.extend(d)
            if d.text is not None:  # decoded on the engine thread (stop strings)
                slot.add_text(d.text)
                self.streamed[d.sample_index] = self.streamed.get(d.sample_index, 0) + len(d.text)
            elif self.detokenizers is not None:
                try:
                    slot.add_text(self.detokenizers[d.sample_index].push(d.token_ids))
                except Exception:  # noqa: BLE001 - a tokenizer that cannot decode must not lose the result
                    self._drop_text()
        if d.final is not None:
            if self.streamed:
                self._end_engine_text(d.final)
            elif self.detokenizers is not None:
                try:
                    self._finish_text(d.final)
                except Exception:  # noqa: BLE001
                    self._drop_text()
            self.final = d.final
            if self.trace is not None:  # on the consumer's side (its loop), never per token
                end_trace(self.trace, d.final)
                self.trace = None

    def _drop_text(self) -> None:
        logger.warning(
            "request %r: decoding its text failed; its deltas and output carry no more text",
            self.request_id,
            exc_info=True,
        )
        self.detokenizers = None

    def _finish_text(self, final: GenerationOutput) -> None:
        """Flush each sample's held-back text into the stream, and give the output its text."""
        samples = final.samples
        detokenizers = self.detokenizers
        assert detokenizers is not None
        for i, detok in enumerate(detokenizers):
            self._add_text(i, detok.flush())
            if samples is not None and i < len(samples) and samples[i].text is None:
                samples[i].text = detok.text
        if final.text is None:
            final.text = detokenizers[0].text

    def _end_engine_text(self, final: GenerationOutput) -> None:
        """The engine decoded the text: the stream ends with whatever of the output's text it has
        not carried yet (what the engine held back when the request was cancelled or failed)."""
        samples = final.samples
        texts = [s.text for s in samples] if samples is not None else [final.text]
        for i, text in enumerate(texts):
            if text is not None:
                self._add_text(i, text[self.streamed.get(i, 0) :])

    def _add_text(self, sample: int, piece: str) -> None:
        if piece:
            slot = self.unread.get(sample)
            if slot is None:
                slot = self.unread[sample] = _Unread(_NO_TOKENS)
            slot.add_text(piece)

    def take(self) -> StreamDelta | None:
        """The coalesced delta of one sample since the last take, or None if there is nothing new.
        The final output rides on the last delta."""
        if self.unread:
            sample = next(iter(self.unread))
            u = self.unread.pop(sample)
            last = self.final is not None and not self.unread
            return StreamDelta(
                self.request_id, u.token_ids, u.logprobs, last, self.final if last else None, u.top, sample, u.text
            )
        if self.final is None:
            return None
        return StreamDelta(self.request_id, [], None, True, self.final)

    def poll(self) -> StreamDelta | None | object:
        """The next stream item: a delta, ``None`` once the stream is over, or ``WAIT``.

        Raises the request's error (once) if it failed.
        """
        if self.stream_done:
            return None
        final = self.final
        if final is not None and (err := _error_of(final)) is not None:
            self.stream_done = True
            raise err
        delta = self.take()
        if delta is None:
            return WAIT
        self.stream_done = delta.finished
        return delta


class AsyncSink:
    """Results of one request for event-loop consumers (asyncio or trio), awaitable from any loop.

    The engine posts each delivery (:meth:`post`, in its order) and calls the sink's ``loop``
    (the submitting loop, or the loop of the consumer that waited last) to :meth:`push` it, with
    one ``call_soon_threadsafe`` per loop per step. A consumer waiting on another loop is woken
    through its own loop, and the sink then follows it there. So two steps in a row may be
    pushed from two loops, and the later step's call may run first (its loop's thread ran while
    the other's did not): a push therefore adds everything posted so far, in the engine's order,
    and a later call finds nothing left. The state is guarded by a lock, since a push and a
    consumer on another loop run on different threads.
    """

    __slots__ = ("loop", "state", "_lock", "_waiters", "_posted")

    def __init__(self, request_id: str, loop: Any) -> None:
        self.loop = loop  # an asyncio loop or a _TrioLoop
        self.state = _SinkState(request_id)
        self._lock = threading.Lock()
        self._waiters: list[tuple[Any, Any]] = []  # (loop, future) of consumers waiting for a push
        # deliveries posted by the engine thread, not yet pushed (a deque: appends and pops are atomic)
        self._posted: deque[Delivery] = deque()

    def post(self, d: Delivery) -> None:
        """On the engine thread: queue one delivery for the next :meth:`push`, from whichever loop."""
        self._posted.append(d)

    def push(self, here: Any = None) -> None:
        """Add every delivery posted so far, in order; ``here`` is the loop this runs on (None:
        another thread, when the sink's loop is closed). Waiters on ``here`` are woken directly,
        others through their loop."""
        with self._lock:
            posted = self._posted
            if not posted:  # an earlier push (from another loop) took them
                return
            while posted:
                self.state.add(posted.popleft())
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            if loop is here:
                wake(fut)
            else:
                wake_threadsafe(loop, fut)

    @property
    def done(self) -> bool:
        return self.state.final is not None

    async def _next(self, read: Callable[[], Any]) -> Any:
        """``read()`` under the lock until it returns something other than ``WAIT``; between tries,
        wait for a push on the running loop (registered under the same lock: no lost wake-up)."""
        loop = current_loop()
        while True:
            with self._lock:
                item = read()
                if item is not WAIT:
                    return item
                fut = loop.create_future()
                self._waiters.append((loop, fut))
                self.loop = loop  # deliver here from now on
            await fut

    async def next_delta(self) -> StreamDelta | None:
        """The next delta; None once the final delta has been returned. Raises on failure."""
        return cast("StreamDelta | None", await self._next(self.state.poll))

    async def result(self) -> GenerationOutput:
        final: GenerationOutput = await self._next(lambda: WAIT if self.state.final is None else self.state.final)
        err = _error_of(final)
        if err is not None:
            raise err
        return final


class ThreadSink:
    """For consumers on plain threads; pushed to directly by the engine thread."""

    __slots__ = ("state", "_cond", "_waiting", "on_final", "on_push")

    loop = None

    def __init__(
        self,
        request_id: str,
        on_final: Callable[[GenerationOutput], None] | None = None,
        on_push: Callable[[Delivery], None] | None = None,
    ) -> None:
        self.state = _SinkState(request_id)
        self._cond = threading.Condition()
        self._waiting = 0  # consumers blocked in wait(): the engine thread notifies only then
        self.on_final = on_final
        self.on_push = on_push

    def push(self, d: Delivery) -> None:
        with self._cond:
            self.state.add(d)
            if self._waiting:
                self._cond.notify_all()
        if self.on_push is not None:
            _call_back(self.on_push, self.state.request_id, d)
        if d.final is not None and self.on_final is not None:
            _call_back(self.on_final, self.state.request_id, d.final)

    @property
    def done(self) -> bool:
        return self.state.final is not None

    def next_delta(self, timeout: float | None = None) -> StreamDelta | None:
        with self._cond:
            while (item := self.state.poll()) is WAIT:
                if not self._wait(timeout):
                    raise TimeoutError(f"no result for request {self.state.request_id!r} within {timeout}s")
            return cast("StreamDelta | None", item)

    def _wait(self, timeout: float | None) -> bool:
        self._waiting += 1
        try:
            return self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def result(self, timeout: float | None = None) -> GenerationOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.state.final is None:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._wait(left):
                    raise TimeoutError(f"request {self.state.request_id!r} not finished within {timeout}s")
            final = self.state.final
        err = _error_of(final)
        if err is not None:
            raise err
        return final


def _call_back(fn: Callable[..., Any], request_id: str, *args: Any) -> None:
    """A user's callback must not take the engine (or other requests' results) down with it."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        logger.exception("a result callback for request %r raised", request_id)


def _push_all(batch: list[AsyncSink], here: Any = None) -> None:
    """Push what was posted to these AsyncSinks, on loop ``here`` (None: on another thread)."""
    for sink in batch:
        _call_back(sink.push, sink.state.request_id, here)


class SinkRegistry:
    """The sinks of the live submits, by ``EngineRequest.sink_key``; :meth:`deliver` is the
    engine's ``deliver`` callback. A sink is registered before its request is posted and
    dropped with its final output (or when its submit is given back). A key the registry does
    not hold (a tensor-parallel follower's copy of the leader's request) is delivered nowhere."""

    def __init__(self) -> None:
        self._sinks: dict[int, Any] = {}
        self._keys = itertools.count()

    def register(self, sink: Any) -> int:
        key = next(self._keys)
        self._sinks[key] = sink
        return key

    def discard(self, key: int) -> None:
        self._sinks.pop(key, None)

    def __len__(self) -> int:
        return len(self._sinks)

    def deliver(self, items: list[Delivery]) -> None:
        """One ``call_soon_threadsafe`` per loop per step. It never raises: a failing sink or
        callback is logged, and the other results still go out."""
        sinks = self._sinks
        per_loop: dict[Any, dict[AsyncSink, None]] = {}  # (a sink once per loop: n > 1 samples post several)
        for d in items:
            sink = sinks.pop(d.key, None) if d.final is not None else sinks.get(d.key)
            if sink is None:
                continue
            loop = sink.loop
            if loop is None:  # a ThreadSink (or a caller's own sink without a loop): push from here
                _call_back(sink.push, sink.state.request_id, d)
            else:
                sink.post(d)
                per_loop.setdefault(loop, {})[sink] = None
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_push_all, list(batch), loop)
            except RuntimeError:  # that loop is closed: the sinks are thread-safe, so push from here
                # (a consumer on another loop may still await them)
                _push_all(list(batch))
