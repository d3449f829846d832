"""Request handles and the sinks that carry results from the engine thread to callers.

The engine thread hands each step's results to :func:`deliver` as one list. Results for
requests awaited on an event loop are grouped per loop and sent with **one** thread-safe,
non-blocking call per loop per step; on the loop, each request's :class:`AsyncSink` appends
the new tokens to what its consumer has not read yet, so a slow consumer gets several steps
coalesced into one delta. Requests consumed from plain threads use :class:`ThreadSink` (a
``threading.Condition``; no event loop needed).

Event loops of either anyio backend are served: an asyncio loop is used as it is
(``loop.call_soon_threadsafe``, ``loop.create_future``); a trio run is seen through a
:class:`_TrioLoop` with the same two methods (``TrioToken.run_sync_soon``, a ``trio.Event``),
so the code below is written once against that small surface. trio is never imported here:
it is only used when the caller is already running it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any, cast

from acb.core.engine_core import Delivery
from acb.errors import EngineDeadError, RequestFailedError
from acb.outputs import FailureKind, GenerationOutput, RequestStatus, StreamDelta
from acb import telemetry
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


class _TrioFuture:
    """trio's stand-in for the bit of ``asyncio.Future`` used here: awaited once, set once."""

    __slots__ = ("_event",)

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.is_set())

    def set_result(self, _value: None) -> None:
        self._event.set()

    def __await__(self) -> Generator[Any, None, None]:
        waiting: Generator[Any, None, None] = self._event.wait().__await__()
        return waiting


class _TrioLoop:
    """One trio run, seen as an event loop (one per run, kept in a ``RunVar``)."""

    __slots__ = ("_token", "_trio")

    def __init__(self, trio: Any) -> None:
        self._trio = trio
        self._token = trio.lowlevel.current_trio_token()

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the run (from any thread, without blocking); RuntimeError once
        the run has finished. Once queued, trio runs it before ``trio.run`` returns."""
        try:
            self._token.run_sync_soon(fn, *args)
        except self._trio.RunFinishedError:
            raise RuntimeError("that trio run has finished") from None

    def create_future(self) -> _TrioFuture:
        return _TrioFuture(self._trio.Event())

    def __repr__(self) -> str:
        return f"<trio run {self._token!r}>"


_trio_loops: Any = None  # trio.lowlevel.RunVar, created on first use under trio


def _trio_loop() -> _TrioLoop:
    global _trio_loops
    trio = sys.modules["trio"]
    if _trio_loops is None:
        _trio_loops = trio.lowlevel.RunVar("acb_event_loop")
    try:
        return cast(_TrioLoop, _trio_loops.get())
    except LookupError:
        loop = _TrioLoop(trio)
        _trio_loops.set(loop)
        return loop


def current_loop() -> Any:
    """The running event loop (asyncio's, or the :class:`_TrioLoop` of the running trio run).
    RuntimeError if there is none, or it belongs to another library."""
    sniffio = sys.modules.get("sniffio")  # trio imports it, and names itself there while it runs
    if sniffio is not None and sniffio.thread_local.name == "trio":
        return _trio_loop()
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    library = None
    if sniffio is not None:
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            pass
    if library is None:
        raise RuntimeError("no running event loop: AsyncEngine is used from asyncio or trio (for plain "
                           "threads, use acb.Engine)")
    raise RuntimeError(f"AsyncEngine runs on asyncio or trio (any anyio backend), not on {library}")


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is the running library's cancellation (asyncio's or trio's)."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


def _wake(fut: Any) -> None:
    """Set a waiter (on its own loop); a waiter already set or cancelled is left alone."""
    if not fut.done():
        fut.set_result(None)


def _wake_threadsafe(loop: Any, fut: Any) -> None:
    try:
        loop.call_soon_threadsafe(_wake, fut)
    except RuntimeError:  # that loop is closed: nobody is waiting there any more
        pass


async def await_future(fut: concurrent.futures.Future[Any]) -> Any:
    """Await a ``concurrent.futures.Future`` (set on another thread) on the running loop;
    cancelling the wait cancels the future if it has not started."""
    loop = current_loop()
    done = loop.create_future()
    fut.add_done_callback(lambda _: _wake_threadsafe(loop, done))
    try:
        await done
    except BaseException:
        fut.cancel()
        raise
    return fut.result()


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


class _HandleBase:
    def __init__(self, request_id: str, sink: Any, cancel: Callable[[str], Any]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._cancel = cancel

    @property
    def done(self) -> bool:
        """Whether the final outcome has arrived."""
        return bool(self._sink.done)

    def cancel(self) -> None:
        """Cancel the request (a no-op once it has ended)."""
        if not self._sink.done:
            self._cancel(self.request_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.request_id!r}, done={self.done})"


class RequestHandle(_HandleBase):
    """An admitted request, awaited on an event loop (asyncio or trio, any of them).

    ``async for delta in handle`` streams new tokens; ``await handle.result()`` gives the final
    :class:`GenerationOutput`. Leaving the loop early, or cancelling the task that awaits (a
    cancel scope under trio), cancels the request. A cancelled request's result has
    ``status == RequestStatus.CANCELLED``; a failed one raises :class:`RequestFailedError` (or
    :class:`EngineDeadError`).
    """

    _sink: AsyncSink

    async def result(self) -> GenerationOutput:
        try:
            return await self._sink.result()
        except BaseException as exc:
            if is_cancellation(exc):
                self.cancel()
            raise

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return HandleStream(self)


class HandleStream:
    """One ``async for`` over a :class:`RequestHandle`.

    A plain iterator rather than an async generator, so that leaving the loop early cancels the
    request at once, under any library: when the loop is left (``break``, an exception in its
    body) the iterator is dropped and ``__del__`` cancels; a cancelled ``__anext__`` (task
    cancelled, trio cancel scope) cancels before re-raising. ``aclose()`` cancels explicitly
    (for ``aclosing``). An async generator would depend on the loop's finalizer hook instead,
    which trio runs later, with a ResourceWarning.
    """

    __slots__ = ("_handle", "_open")

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._open = True  # False once the stream has ended, or was given up (request cancelled)

    def __aiter__(self) -> "HandleStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._open:
            raise StopAsyncIteration
        try:
            delta = await self._handle._sink.next_delta()
        except BaseException:
            # cancellation, or the request's failure: in every case nobody reads on; cancelling
            # an ended request is a no-op
            self._open = False
            self._handle.cancel()
            raise
        if delta is None:
            self._open = False
            raise StopAsyncIteration
        return delta

    async def aclose(self) -> None:
        """Stop reading: cancels the request unless it has ended."""
        self._give_up()

    def _give_up(self) -> None:
        if self._open:
            self._open = False
            self._handle.cancel()

    def __del__(self) -> None:
        try:
            self._give_up()  # the consumer left the loop early: the request is not wanted
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass


class SyncRequestHandle(_HandleBase):
    """The blocking twin of :class:`RequestHandle`: iterating blocks, ``result()`` blocks."""

    _sink: ThreadSink

    def result(self, timeout: float | None = None) -> GenerationOutput:
        return self._sink.result(timeout)

    def __iter__(self) -> Iterator[StreamDelta]:
        try:
            while (delta := self._sink.next_delta()) is not None:
                yield delta
        finally:
            self.cancel()


class AdmissionGate:
    """Bounds the requests waiting to be scheduled (``max_queue_size``; 0 = unbounded).

    A slot is taken at submit and given back when the request is first scheduled (or ends
    before that). Waiters on event loops are woken through their loop; thread waiters
    through a condition.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[Any, Any]] = []  # (loop, future) of waiting submits

    def try_acquire(self) -> bool:
        if self.limit <= 0:
            return True
        with self._cond:
            if self._count < self.limit:
                self._count += 1
                return True
            return False

    def release(self, n: int = 1) -> None:
        if self.limit <= 0:
            return
        with self._cond:
            self._count = max(0, self._count - n)
            self._wake_all()

    def close(self) -> None:
        """Stop bounding (the engine is gone): wake every waiter so it can see that."""
        self.limit = 0
        with self._cond:
            self._wake_all()

    def _wake_all(self) -> None:
        """Wake every waiter; they re-check the count themselves (caller holds ``_cond``)."""
        waiters, self._async_waiters = self._async_waiters, []
        self._cond.notify_all()
        for loop, fut in waiters:
            _wake_threadsafe(loop, fut)

    def acquire_blocking(self, timeout: float | None = None) -> bool:
        if self.limit <= 0:
            return True
        with self._cond:
            ok = self._cond.wait_for(lambda: self.limit <= 0 or self._count < self.limit, timeout)
            if ok:
                self._count += 1
            return ok

    async def acquire(self) -> None:
        """Take a slot, waiting (on the running loop) while none is free. Cancelled while waiting,
        it takes nothing."""
        if self.limit <= 0:
            return
        loop = current_loop()
        while True:
            with self._cond:
                if self.limit <= 0 or self._count < self.limit:
                    self._count += 1
                    return
                fut = loop.create_future()
                self._async_waiters.append((loop, fut))
            await fut

