"""The render pool: a few daemon threads that render chats and tokenize prompts for the server,
off its event loop, each job within a time bound (:class:`RenderPool`)."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from acb.serve.protocol import APIError

DEFAULT_RENDER_TIMEOUT = 10.0  # seconds a request's chat rendering / tokenizing may take
DEFAULT_RENDER_THREADS = 4


class RenderTimeout(BaseException):
    """A render job ran past its deadline. A BaseException, so that no ``except Exception`` in
    a template runtime or tokenizer swallows it."""


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[bool, Any]]
    started: bool = field(default=False)


class RenderPool:
    """A few daemon threads that render chats and tokenize prompts for the server, off its event
    loop, each job within ``timeout`` seconds of being queued.

    A job that runs past its deadline is stopped where it can be: its thread carries a profile
    hook that raises :class:`RenderTimeout` at the job's next Python or C function call after the
    deadline, which ends a chat template's loops (every iteration calls into the template
    runtime). A thread cannot be killed, so what cannot be stopped that way (one long C call,
    such as tokenizing a huge text) holds its thread until it ends; that is why the threads are
    few (``threads``: at most that many jobs run at once, whatever clients send), are daemon
    threads (never holding the process at exit), and why a job still queued at its deadline is
    skipped. anyio's worker threads would do neither: they are not daemon, and a wait that gives
    up frees its slot while the thread runs on.

    :meth:`run` raises :class:`APIError`: 400 when a job ran past its deadline (the request's
    own work; not 408, which clients retry), 503 when it never got a thread in time.
    """

    def __init__(self, threads: int = DEFAULT_RENDER_THREADS, timeout: float = DEFAULT_RENDER_TIMEOUT) -> None:
        if threads < 1 or not timeout > 0:
            raise ValueError(f"a render pool needs threads >= 1 and timeout > 0, got {threads} and {timeout}")
        self.timeout = timeout
        self.size = threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            while len(self._threads) < self.size:
                t = threading.Thread(target=self._work, name=f"acb-render-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def close(self) -> None:
        """Let idle threads exit (a running job finishes first)."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads.clear()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a pool thread, within the time bound.

        Args:
            fn: the job (rendering a chat, tokenizing prompts).
            *args: its arguments.

        Returns:
            What ``fn`` returned.

        Raises:
            APIError: 400 when the job ran past its deadline, 503 when it never got a thread in time.
            Exception: whatever ``fn`` raised, re-raised.
        """
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, time.monotonic() + self.timeout, loop, loop.create_future())
        self._start()
        self._jobs.put(job)
        result: tuple[bool, Any] | None = None
        with anyio.move_on_after(self.timeout + 0.05):  # the hook's own margin: a job that cannot be stopped
            result = await job.future
        if result is None or isinstance(result[1], RenderTimeout):
            job.future.cancel()  # a job not started yet is skipped
            if job.started:
                raise APIError(
                    400,
                    f"rendering the prompt took longer than this server's {self.timeout:g} s",
                    code="render_timeout",
                )
            raise APIError(
                503,
                "the server is busy preparing other requests' prompts",
                type="server_error",
                headers={"Retry-After": "1"},
            )
        ok, value = result
        if not ok:
            raise value
        return value

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.future.cancelled() or time.monotonic() >= job.deadline:
                self._settle(job, (False, RenderTimeout()))
                continue
            job.started = True
            try:
                outcome: tuple[bool, Any] = (True, _bounded(job.fn, job.args, job.deadline))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                outcome = (False, exc)
            self._settle(job, outcome)

    @staticmethod
    def _settle(job: _Job, outcome: tuple[bool, Any]) -> None:
        def settle() -> None:
            if not job.future.done():
                job.future.set_result(outcome)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits
            pass


def _bounded(fn: Callable[..., Any], args: tuple[Any, ...], deadline: float) -> Any:
    """``fn(*args)`` in this thread, raising :class:`RenderTimeout` at its first function call past
    ``deadline``. CPython removes a profile hook that raised, so the unwinding runs unhooked."""
    clock = time.monotonic

    def hook(frame: Any, event: str, arg: Any) -> None:
        if clock() > deadline:
            raise RenderTimeout

    sys.setprofile(hook)
    try:
        return fn(*args)
    finally:
        sys.setprofile(None)
