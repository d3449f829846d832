"""The admission gate: at most ``max_queue_size`` requests waiting to be scheduled."""

from __future__ import annotations

import logging
import threading
from typing import Any

from acb.api.loops import current_loop, wake_threadsafe

logger = logging.getLogger(__name__)


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
            wake_threadsafe(loop, fut)

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
