"""The sinks that carry results from the engine thread to callers, and :func:`deliver`.

The engine thread hands each step's results to :func:`deliver` as one list. Results for
requests awaited on an event loop are grouped per loop and sent with **one** thread-safe,
non-blocking call per loop per step; on the loop, each request's :class:`AsyncSink` appends
the new tokens to what its consumer has not read yet, so a slow consumer gets several steps
coalesced into one delta. Requests consumed from plain threads use :class:`ThreadSink` (a
``threading.Condition``; no event loop needed). Text is decoded on the consumer's side, here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from acb import telemetry
from acb.api.loops import _wake, _wake_threadsafe, current_loop
from acb.core.engine_core import Delivery
from acb.errors import EngineDeadError, RequestFailedError
from acb.outputs import FailureKind, GenerationOutput, RequestStatus, StreamDelta
from acb.telemetry import RequestTrace
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

    __slots__ = ("request_id", "unread", "final", "stream_done", "detokenizers", "trace")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
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
            if self.detokenizers is not None:
                try:
                    slot.add_text(self.detokenizers[d.sample_index].push(d.token_ids))
                except Exception:  # noqa: BLE001 - a tokenizer that cannot decode must not lose the result
                    self._drop_text()
        if d.final is not None:
            if self.detokenizers is not None:
                try:
                    self._finish_text(d.final)
                except Exception:  # noqa: BLE001
                    self._drop_text()
            self.final = d.final
            if self.trace is not None:  # on the consumer's side (its loop), never per token
                telemetry.end(self.trace, d.final)
                self.trace = None

    def _drop_text(self) -> None:
        logger.warning("request %r: decoding its text failed; its deltas and output carry no more text",
                       self.request_id, exc_info=True)
        self.detokenizers = None

    def _finish_text(self, final: GenerationOutput) -> None:
        """Flush each sample's held-back text into the stream, and give the output its text (the
        stop-string cut, when a stop string ended it, is kept)."""
        samples = final.samples
        detokenizers = self.detokenizers
        assert detokenizers is not None
        for i, detok in enumerate(detokenizers):
            # a stop string cut the engine's text: the stream ends where it does
            cut = samples[i].text if samples is not None and i < len(samples) else final.text
            piece = detok.flush(None if cut is None else len(cut))
            if piece:
                slot = self.unread.get(i)
                if slot is None:
                    slot = self.unread[i] = _Unread(Delivery(None, []))
                slot.add_text(piece)
            if samples is not None and i < len(samples) and samples[i].text is None:
                samples[i].text = detok.text
        if final.text is None:
            final.text = detokenizers[0].text

    def take(self) -> StreamDelta | None:
        """The coalesced delta of one sample since the last take, or None if there is nothing new.
        The final output rides on the last delta."""
        if self.unread:
            sample = next(iter(self.unread))
            u = self.unread.pop(sample)
            last = self.final is not None and not self.unread
            return StreamDelta(self.request_id, u.token_ids, u.logprobs, last, self.final if last else None, u.top,
                               sample, u.text)
        if self.final is None:
            return None
        return StreamDelta(self.request_id, [], None, True, self.final)

    def poll(self) -> "StreamDelta | None | object":
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

    The engine delivers to the sink's ``loop`` (the submitting loop, or the loop of the consumer
    that waited last) with one ``call_soon_threadsafe`` per loop per step. A consumer waiting on
    another loop is woken through its own loop, and the sink then follows it there. The state
    is guarded by a lock, since a push and a consumer on another loop run on different threads.
    """

    __slots__ = ("loop", "state", "_lock", "_waiters")

    def __init__(self, request_id: str, loop: Any) -> None:
        self.loop = loop  # an asyncio loop or a _TrioLoop
        self.state = _SinkState(request_id)
        self._lock = threading.Lock()
        self._waiters: list[tuple[Any, Any]] = []  # (loop, future) of consumers waiting for a push

    def push(self, d: Delivery, here: Any = None) -> None:
        """Add one delivery; ``here`` is the loop this runs on (None: another thread, when the
        sink's loop is closed). Waiters on ``here`` are woken directly, others through their loop."""
        with self._lock:
            self.state.add(d)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            if loop is here:
                _wake(fut)
            else:
                _wake_threadsafe(loop, fut)

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


def _push_all(batch: list[Delivery], here: Any = None) -> None:
    """Push a batch of deliveries into their AsyncSinks, on loop ``here`` (None: on another thread)."""
    for d in batch:
        _call_back(d.sink.push, d.sink.state.request_id, d, here)


def deliver(items: list[Delivery]) -> None:
    """The engine's ``deliver`` callback: one ``call_soon_threadsafe`` per loop per step. It never
    raises: a failing sink or callback is logged, and the other results still go out."""
    per_loop: dict[Any, list[Delivery]] = {}
    for d in items:
        loop = d.sink.loop
        if loop is None:  # a ThreadSink (or a caller's own sink without a loop): push from here
            _call_back(d.sink.push, d.sink.state.request_id, d)
        else:
            per_loop.setdefault(loop, []).append(d)
    for loop, batch in per_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, batch, loop)
        except RuntimeError:  # that loop is closed: the sinks are thread-safe, so push from here
            # (a consumer on another loop may still await them)
            _push_all(batch)


