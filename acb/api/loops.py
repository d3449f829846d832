"""Event-loop plumbing shared by the sinks, the handles and the admission gate.

Event loops of either anyio backend are served: an asyncio loop is used as it is
(``loop.call_soon_threadsafe``, ``loop.create_future``); a trio run is seen through a
:class:`_TrioLoop` with the same two methods (``TrioToken.run_sync_soon``, a ``trio.Event``),
so the code that uses a loop is written once against that small surface. trio is never
imported here: it is only used when the caller is already running it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
from collections.abc import Callable, Generator
from typing import Any, cast

logger = logging.getLogger(__name__)


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
        raise RuntimeError(
            "no running event loop: AsyncEngine is used from asyncio or trio (for plain threads, use acb.Engine)"
        )
    raise RuntimeError(f"AsyncEngine runs on asyncio or trio (any anyio backend), not on {library}")


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is the running library's cancellation (asyncio's or trio's)."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


def wake(fut: Any) -> None:
    """Set a waiter (on its own loop); a waiter already set or cancelled is left alone."""
    if not fut.done():
        fut.set_result(None)


def wake_threadsafe(loop: Any, fut: Any) -> None:
    """:func:`wake` a waiter from another thread, through its loop (a closed loop: nobody waits)."""
    try:
        loop.call_soon_threadsafe(wake, fut)
    except RuntimeError:  # that loop is closed: nobody is waiting there any more
        pass


async def await_future(fut: concurrent.futures.Future[Any]) -> Any:
    """Await a ``concurrent.futures.Future`` (set on another thread) on the running loop;
    cancelling the wait cancels the future if it has not started."""
    loop = current_loop()
    done = loop.create_future()
    fut.add_done_callback(lambda _: wake_threadsafe(loop, done))
    try:
        await done
    except BaseException:
        fut.cancel()
        raise
    return fut.result()
