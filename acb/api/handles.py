"""Request handles: what ``submit`` returns (:class:`RequestHandle` on an event loop,
:class:`SyncRequestHandle` on a plain thread), reading what the request's sink
(:mod:`acb.api.sinks`) collected. The sinks, the gate and the event-loop plumbing live in their
own modules; their names are re-exported here for the code that imported them from here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from acb.api.gate import AdmissionGate
from acb.api.loops import await_future, current_loop, is_cancellation
from acb.api.sinks import AsyncSink, ThreadSink
from acb.outputs import GenerationOutput, StreamDelta

__all__ = [
    "AdmissionGate",
    "AsyncSink",
    "HandleStream",
    "RequestHandle",
    "SyncRequestHandle",
    "ThreadSink",
    "await_future",
    "current_loop",
    "is_cancellation",
]

logger = logging.getLogger(__name__)


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
        """Wait for the request's final output. Cancelling the awaiting task cancels the request.

        Returns:
            The :class:`GenerationOutput` (``status`` FINISHED, or CANCELLED).

        Raises:
            RequestFailedError: the engine failed the request (``.output`` has what it made).
            EngineDeadError: the engine died.
        """
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

    def __aiter__(self) -> HandleStream:
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
        """Block until the request's final output.

        Args:
            timeout: the most seconds to wait (``None``: no limit).

        Returns:
            The :class:`GenerationOutput` (``status`` FINISHED, or CANCELLED).

        Raises:
            TimeoutError: no output within ``timeout``.
            RequestFailedError: the engine failed the request (``.output`` has what it made).
            EngineDeadError: the engine died.
        """
        return self._sink.result(timeout)

    def __iter__(self) -> Iterator[StreamDelta]:
        try:
            while (delta := self._sink.next_delta()) is not None:
                yield delta
        finally:
            self.cancel()
