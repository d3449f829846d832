"""The holds on the engine's steps: the caller's pause, and sleep.

Contract (the engine thread owns a :class:`Holds` and calls it between steps; nothing here
touches a device, a scheduler or a thread):

- Two independent holds compose. The **pause** is :class:`PauseState`: ``RUNNING``;
  ``DRAINING`` (``pause("wait")``: the live requests finish, requests added meanwhile are
  *held* here, not scheduled); ``PAUSED`` (no steps run; requests added go to the scheduler's
  queue and run on resume). Only :meth:`Holds.resume` (or :meth:`Holds.leave`, on stop) ends a
  pause. **Sleep** is the runner's (``asleep()``, given at construction): while asleep no step
  runs, whatever the pause state, and waking gives back exactly the pause state there was (a
  drain that sleep interrupted goes on; an explicit pause stays).
- Steps run when neither holds them (:meth:`Holds.may_step`): a drain still runs its live
  requests. :attr:`Holds.paused` is true under any hold (draining included).
- ``pause("wait")`` from ``RUNNING`` or ``DRAINING`` drains: its Future completes when the
  drain ends (:meth:`Holds.drained` once the engine has no work). ``pause("cancel")`` and
  ``pause("keep")``, and ``pause("wait")`` when already paused, take effect at once: the
  ``quiesce`` callback settles the engine first (given True for ``"cancel"``: cancel every
  live request), then the pause is entered and the Future completes.
- Entering ``PAUSED`` (:meth:`Holds.enter_paused`) releases the held requests to the queue in
  the order they came, in one go, then calls ``changed`` (the engine's stats), then completes
  every waiting ``pause()`` Future, so a caller that hears the pause finished sees it counted.
- A pause Future its caller cancelled first is ignored (the command had no effect). A pause
  while the engine stops fails with :class:`acb.errors.EngineNotRunningError`; so do the
  waiting ones when the engine exits (:meth:`Holds.close`). ``resume()`` while asleep fails with
  a ``RuntimeError`` (wake first), and leaves the pause as it was.

The commands return True when they changed what the engine runs, which is what a
tensor-parallel leader sends its followers.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from acb.errors import EngineNotRunningError

__all__ = ["PAUSE_MODES", "Holds", "PauseState"]

PAUSE_MODES = ("wait", "cancel", "keep")

T = TypeVar("T")


class PauseState(enum.Enum):
    """The caller's hold on the steps (sleep is the other hold: the runner's ``asleep``)."""

    RUNNING = "running"
    DRAINING = "draining"  # pause("wait"): the live requests finish, new ones are held
    PAUSED = "paused"  # no steps run


class Holds(Generic[T]):
    """The pause state machine, the requests it holds while draining, and the ``pause()``
    Futures waiting for a drain (``T``: the engine's request type)."""

    def __init__(
        self, *, asleep: Callable[[], bool], release: Callable[[T], None], changed: Callable[[], None]
    ) -> None:
        """Args:
        asleep: whether the runner sleeps (the other hold).
        release: hands a held request to the scheduler's queue.
        changed: called when the holds changed (the engine publishes its stats).
        """
        self.state = PauseState.RUNNING
        self.held: deque[T] = deque()  # requests added while draining for a pause
        self._waiters: list[Future[None]] = []  # pause() calls waiting for the drain to end
        self._asleep = asleep
        self._release = release
        self._changed = changed

    @property
    def paused(self) -> bool:
        """Whether steps are held back: paused, draining for a pause, or asleep."""
        return self.state is not PauseState.RUNNING or self._asleep()

    def may_step(self) -> bool:
        """Returns:
        Whether steps may run: not paused (a drain still runs its live requests) and awake.
        """
        return self.state is not PauseState.PAUSED and not self._asleep()

    def hold(self, item: T) -> bool:
        """Hold a newly added request while draining.

        Args:
            item: the request.

        Returns:
            True if it is held here (until the pause is entered); False if the caller schedules it.
        """
        if self.state is PauseState.DRAINING:
            self.held.append(item)
            return True
        return False

    def unhold(self, match: Callable[[T], bool]) -> T | None:
        """Take the first held request ``match`` accepts out of the holds.

        Args:
            match: the test.

        Returns:
            The request, or None if none is held.
        """
        item = next((r for r in self.held if match(r)), None)
        if item is not None:
            self.held.remove(item)
        return item

    def take_held(self) -> list[T]:
        """Returns:
        Every held request, in order, no longer held (the engine stops or dies).
        """
        items = list(self.held)
        self.held.clear()
        return items

    def pause(self, mode: str, fut: Future[None], *, stopping: bool, quiesce: Callable[[bool], None]) -> bool:
        """Apply a ``pause(mode)`` command.

        Args:
            mode: ``"wait"``, ``"cancel"`` or ``"keep"`` (checked by the caller).
            fut: completes once paused.
            stopping: the engine is stopping (the pause fails).
            quiesce: settles the engine before an immediate pause; given True to cancel every
                live request.

        Returns:
            True if the pause took effect (or began draining).
        """
        if not fut.set_running_or_notify_cancel():
            return False
        if stopping:
            fut.set_exception(EngineNotRunningError("the engine is stopping"))
            return False
        if mode == "wait" and self.state is not PauseState.PAUSED:
            self.state = PauseState.DRAINING
            self._waiters.append(fut)
            return True
        quiesce(mode == "cancel")
        self.enter_paused()
        fut.set_result(None)
        return True

    def drained(self, has_work: bool) -> None:
        """The engine is idle: a drain with no work left becomes the pause.

        Args:
            has_work: whether the scheduler still has live requests.
        """
        if self.state is PauseState.DRAINING and not has_work:
            self.enter_paused()

    def enter_paused(self) -> None:
        """No more steps: requests held while draining join the queue (they run on resume), and
        the waiting ``pause()`` calls complete."""
        self.state = PauseState.PAUSED
        while self.held:
            self._release(self.held.popleft())
        self._changed()
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.set_result(None)

    def leave(self) -> None:
        """End the pause (resume, or a stop): the held requests join the queue, the waiting
        ``pause()`` calls complete, and steps run again (unless asleep)."""
        self.enter_paused()
        self.state = PauseState.RUNNING
        self._changed()

    def resume(self, fut: Future[None]) -> bool:
        """Apply a ``resume()`` command.

        Args:
            fut: completes once resumed; fails with a ``RuntimeError`` while asleep.

        Returns:
            True if the pause ended.
        """
        if not fut.set_running_or_notify_cancel():
            return False
        if self._asleep():
            fut.set_exception(RuntimeError("the engine is asleep: call wake_up() before resume()"))
            return False
        self.leave()
        fut.set_result(None)
        return True

    def close(self) -> None:
        """The engine exits: every waiting ``pause()`` fails with ``EngineNotRunningError``."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.set_exception(EngineNotRunningError("the engine stopped before the pause completed"))
