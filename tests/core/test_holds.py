"""The pause/sleep holds as a state machine of their own (acb.core.holds), without an engine."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from acb.core.holds import Holds, PauseState
from acb.errors import EngineNotRunningError


class Rig:
    """A Holds over strings, recording what it releases and each ``changed`` call (with the
    number of pause Futures already complete at that moment)."""

    def __init__(self) -> None:
        self.asleep = False
        self.released: list[str] = []
        self.changes: list[int] = []
        self.quiesced: list[bool] = []
        self.futs: list[Future[None]] = []
        self.holds: Holds[str] = Holds(
            asleep=lambda: self.asleep,
            release=self.released.append,
            changed=lambda: self.changes.append(sum(f.done() for f in self.futs)),
        )

    def pause(self, mode: str, *, stopping: bool = False) -> tuple[bool, Future[None]]:
        fut: Future[None] = Future()
        self.futs.append(fut)
        return self.holds.pause(mode, fut, stopping=stopping, quiesce=self.quiesced.append), fut

    def resume(self) -> tuple[bool, Future[None]]:
        fut: Future[None] = Future()
        return self.holds.resume(fut), fut


def test_running_holds_nothing():
    r = Rig()
    assert r.holds.state is PauseState.RUNNING and r.holds.may_step() and not r.holds.paused
    assert not r.holds.hold("a") and not r.holds.held


def test_a_waiting_pause_drains_holding_new_requests_then_pauses_releasing_them_in_order():
    r = Rig()
    applied, fut = r.pause("wait")
    assert applied and not fut.done() and r.quiesced == []
    assert r.holds.state is PauseState.DRAINING and r.holds.paused and r.holds.may_step()
    assert r.holds.hold("a") and r.holds.hold("b")
    again, fut2 = r.pause("wait")  # a second waiter joins the drain
    assert again and not fut2.done()
    r.holds.drained(has_work=True)
    assert r.holds.state is PauseState.DRAINING and not fut.done()
    r.holds.drained(has_work=False)
    assert r.holds.state is PauseState.PAUSED and not r.holds.may_step()
    assert r.released == ["a", "b"] and not r.holds.held
    assert fut.result() is None and fut2.result() is None
    assert r.changes == [0]  # the stats were published before any pause() caller heard of it
    assert not r.holds.hold("c")  # paused: new requests go to the queue


@pytest.mark.parametrize("mode", ["keep", "cancel"])
def test_keep_and_cancel_pause_at_once_after_quiescing(mode):
    r = Rig()
    applied, fut = r.pause(mode)
    assert applied and fut.done() and r.quiesced == [mode == "cancel"]
    assert r.holds.state is PauseState.PAUSED and r.changes == [0]


def test_a_pause_during_a_drain_ends_it_and_completes_the_waiters():
    r = Rig()
    _, waiting = r.pause("wait")
    r.holds.hold("a")
    _, now = r.pause("keep")
    assert waiting.done() and now.done() and r.released == ["a"] and r.holds.state is PauseState.PAUSED


def test_a_waiting_pause_when_paused_is_immediate():
    r = Rig()
    r.pause("keep")
    applied, fut = r.pause("wait")
    assert applied and fut.done() and r.quiesced == [False, False]


def test_a_cancelled_future_or_a_stopping_engine_changes_nothing():
    r = Rig()
    fut: Future[None] = Future()
    fut.cancel()
    assert not r.holds.pause("wait", fut, stopping=False, quiesce=r.quiesced.append)
    assert r.holds.state is PauseState.RUNNING
    applied, fut = r.pause("keep", stopping=True)
    assert not applied and isinstance(fut.exception(), EngineNotRunningError)
    assert r.holds.state is PauseState.RUNNING and r.quiesced == [] and r.changes == []


def test_resume_ends_a_pause_or_a_drain_releasing_what_was_held():
    r = Rig()
    _, waiting = r.pause("wait")
    r.holds.hold("a")
    applied, fut = r.resume()
    assert applied and fut.done() and waiting.done()
    assert r.holds.state is PauseState.RUNNING and r.released == ["a"] and not r.holds.paused


def test_sleep_holds_the_steps_and_waking_gives_back_the_pause_state():
    r = Rig()
    r.pause("wait")
    r.asleep = True
    assert r.holds.paused and not r.holds.may_step() and r.holds.state is PauseState.DRAINING
    applied, fut = r.resume()
    assert not applied and isinstance(fut.exception(), RuntimeError)
    assert r.holds.state is PauseState.DRAINING  # unchanged: wake first
    r.asleep = False
    assert r.holds.may_step() and r.holds.state is PauseState.DRAINING  # the drain goes on


def test_unhold_take_held_and_close():
    r = Rig()
    _, fut = r.pause("wait")
    for x in "abc":
        r.holds.hold(x)
    assert r.holds.unhold(lambda x: x == "b") == "b" and r.holds.unhold(lambda x: x == "z") is None
    assert r.holds.take_held() == ["a", "c"] and not r.holds.held
    r.holds.close()
    assert isinstance(fut.exception(), EngineNotRunningError)


def test_a_stop_leaves_the_pause():
    r = Rig()
    r.pause("keep")
    r.holds.leave()
    assert r.holds.state is PauseState.RUNNING and r.changes == [0, 1, 1]
