"""AsyncEngine on every anyio backend (asyncio and trio): cancel scopes, waiting for a queue slot,
engine death, shutdown under cancellation, text streams, handles shared between loops and
libraries. The general stream/result/cancel contracts are in test_async_engine.py (also run
on both backends)."""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import threading
import warnings

import anyio
import pytest

import acb
from acb.api import loops
from acb.models import build_tokenizer
from tests.conftest import HANG_GUARD, get_model, reference_generate

pytestmark = pytest.mark.anyio

LONG = acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True)


def engine(model=None, tokenizer=None, **kw) -> acb.AsyncEngine:
    cfg = acb.ContinuousBatchingConfig(**{"page_size": 8, "num_blocks": 128, **kw})
    return acb.AsyncEngine(model if model is not None else get_model("llama"), cfg, tokenizer=tokenizer)


def other_backend(backend: str) -> str:
    return {"asyncio": "trio", "trio": "asyncio"}[backend]


async def wait_until(cond, timeout: float = 30) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


async def test_tests_run_on_the_backend_they_name(anyio_backend):
    # pytest-asyncio in auto mode would run the [trio] variants on asyncio (see tests/conftest.py)
    loop = loops.current_loop()
    if anyio_backend == "trio":
        assert isinstance(loop, loops._TrioLoop) and loops.current_loop() is loop  # one per run
        assert "trio" in sys.modules and sys.modules["sniffio"].current_async_library() == "trio"
    else:
        assert loop is asyncio.get_running_loop()


async def test_cancelled_while_waiting_for_a_queue_slot_gives_the_id_back():
    async with engine(max_queue_size=1, max_requests_per_batch=1) as eng:
        h0 = await eng.submit([5], LONG)
        await wait_until(lambda: eng.stats.running == 1)
        h1 = eng.submit_nowait([6], LONG)  # the queue is full now
        held = threading.Event()
        eng.core.call(lambda c: held.wait(HANG_GUARD))  # no slot can free up while the engine is held
        with anyio.move_on_after(0.2) as scope:  # a trio cancel scope under trio
            await eng.submit([7], acb.SamplingParams(max_new_tokens=2), request_id="patient")
        assert scope.cancelled_caught
        assert not eng.ids.is_live("patient")
        # still full, and the id is free again: QueueFullError, not "already used"
        with pytest.raises(acb.QueueFullError):
            eng.submit_nowait([7], request_id="patient")
        # the same from a task cancelled by its task group (nursery)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(eng.submit, [7], request_id="patient"))
            await anyio.wait_all_tasks_blocked()  # the submit is parked on the queue's gate
            tg.cancel_scope.cancel()
        assert not eng.ids.is_live("patient")
        held.set()
        h0.cancel()
        h1.cancel()  # the queue slot and the row are free again
        with anyio.fail_after(30):
            out = await eng.generate([7], acb.SamplingParams(max_new_tokens=2), request_id="patient")
        assert out.status == acb.RequestStatus.FINISHED and out.request_id == "patient"
        assert (await h0.result()).status == (await h1.result()).status == acb.RequestStatus.CANCELLED


async def test_leaving_the_loop_cancels_at_once_and_without_warnings(monkeypatch):
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], LONG)
        cancels: list[str] = []
        real_cancel = eng.core.cancel
        monkeypatch.setattr(eng.core, "cancel", lambda rid: (cancels.append(rid), real_cancel(rid)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async for _ in h:
                break
            assert cancels == [h.request_id]  # at the break, not when the loop gets round to it
            gc.collect()
            with anyio.fail_after(30):
                out = await h.result()
        # (an async generator would be finalized by trio later, with a ResourceWarning)
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w) for w in caught]
    assert out.status == acb.RequestStatus.CANCELLED and cancels == [h.request_id]


async def test_an_exception_in_the_consumer_cancels_the_request():
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], LONG)
        with pytest.raises(KeyError):
            async for _ in h:
                raise KeyError("consumer bug")
        with anyio.fail_after(30):
            out = await h.result()
    assert out.status == acb.RequestStatus.CANCELLED


async def test_engine_death_reaches_every_handle_and_waiting_submit(monkeypatch):
    eng = engine(max_queue_size=1, max_requests_per_batch=1)
    eng.start()
    h0 = await eng.submit([5, 6, 7], LONG)
    await wait_until(lambda: eng.stats.running == 1)
    h1 = eng.submit_nowait([8, 9], LONG)  # queued: the queue is full
    errors: list[BaseException] = []

    async def waiting_submit():
        try:
            await eng.submit([4], LONG)
        except acb.EngineDeadError as e:
            errors.append(e)

    def broken(*a, **k):
        raise AssertionError("scheduler bug")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting_submit)
            await anyio.wait_all_tasks_blocked()  # the submit is parked on the queue's gate
            monkeypatch.setattr(eng.core.scheduler, "schedule", broken)
            with pytest.raises(acb.EngineDeadError):
                async for _ in h0:
                    pass
            with pytest.raises(acb.EngineDeadError):
                await h1.result()
    assert len(errors) == 1  # the submit waiting for a slot heard of it too
    await anyio.to_thread.run_sync(eng.join, 30)
    assert not eng.is_running and not eng.ids.live
    with pytest.raises(acb.EngineDeadError):
        await eng.submit([5])


async def test_leaving_the_engine_block_in_a_cancelled_scope_stops_the_engine():
    with anyio.CancelScope() as scope:
        async with engine() as eng:
            h = await eng.submit([5, 6, 7], LONG)
            scope.cancel()
            await anyio.sleep(30)  # cancelled here: __aexit__ runs inside a cancelled scope
    assert scope.cancelled_caught
    assert not eng.is_running  # the shutdown was shielded and waited for
    assert (await h.result()).status == acb.RequestStatus.CANCELLED


async def test_a_cancelled_shutdown_still_stops_the_engine():
    eng = engine()
    eng.start()
    h = await eng.submit([5, 6, 7], LONG)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await eng.shutdown()  # the wait is cancelled; the stop was asked for first
    await anyio.to_thread.run_sync(eng.join, 30)
    assert not eng.is_running
    assert (await h.result()).status == acb.RequestStatus.CANCELLED


async def test_reset_prefix_cache_while_a_request_runs():
    prompt = list(range(3, 30))
    async with engine() as eng:
        await eng.generate(prompt, acb.SamplingParams(max_new_tokens=2))
        running = await eng.submit([5, 6, 7], LONG)
        assert await eng.reset_prefix_cache() >= 3
        again = await eng.generate(prompt, acb.SamplingParams(max_new_tokens=2))
        assert again.num_cached_tokens == 0
        running.cancel()
        assert (await running.result()).status == acb.RequestStatus.CANCELLED


@functools.cache
def byte_tokenizer():
    return build_tokenizer()  # byte-level, built in code


@functools.cache
def text_case() -> tuple[list[int], list[int]]:
    """The prompt and its greedy reference for the text-streaming test (before any engine runs)."""
    tok = byte_tokenizer()
    ids = tok("héllo wörld 😀")["input_ids"]
    return ids, reference_generate(get_model("llama", vocab_size=len(tok)), ids, 16)


async def test_text_streams():
    tok = byte_tokenizer()
    ids, ref = text_case()
    model = get_model("llama", vocab_size=len(tok))
    async with engine(model, tokenizer=tok) as eng:
        h = await eng.submit("héllo wörld 😀", acb.SamplingParams(max_new_tokens=16, ignore_eos=True))
        deltas = [d async for d in h]
        out = await h.result()
    assert out.prompt_ids == ids and out.generated_tokens == ref
    full = tok.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(d.text or "" for d in deltas) == out.text == full
    assert sum((d.token_ids for d in deltas), []) == ref


class StepGate:
    """A forward pre-hook on a model's input embeddings: each forward (one engine step) waits for a
    permit from the test, until :meth:`open`. ``started`` counts the forwards begun."""

    def __init__(self, model) -> None:
        self.started = 0
        self._permits = threading.Semaphore(0)
        self._opened = False
        self._changed = threading.Condition()
        self._hook = model.get_input_embeddings().register_forward_pre_hook(self._gate)

    def _gate(self, _module, _args) -> None:
        with self._changed:
            self.started += 1
            self._changed.notify_all()
        if not self._opened:
            assert self._permits.acquire(timeout=HANG_GUARD), "the test never let this step run"

    def allow(self, n: int) -> None:
        self._permits.release(n)

    def wait_started(self, n: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.started >= n, HANG_GUARD), f"{self.started} steps, not {n}"

    def open(self) -> None:
        self._opened = True
        self._permits.release(1_000)

    def remove(self) -> None:
        self.open()
        self._hook.remove()


async def test_one_handle_awaited_on_two_loops_at_once(anyio_backend):
    """This loop streams while a loop of the other library, on another thread, awaits the result.

    The engine calls the loop of the consumer that waited last, so two steps in a row may be
    pushed from two loops; a loop whose thread does not run for a while (a loaded machine) held
    its step back while the next step reached the stream through the other loop: the stream gave
    the tokens out of order (tokens 34 and 35 swapped, seen "under load"). Constructed here: the
    other loop waits for the result, then stalls while the first steps are posted to it; this loop
    then waits on the stream and gets the later steps. The stream must still be in order."""
    model = get_model("llama")
    ref = reference_generate(model, [5, 6, 7], 60)  # before the engine runs
    async with engine() as eng:
        gate = StepGate(model)
        try:
            h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=60))
            waiting, thaw = threading.Event(), threading.Event()

            async def there() -> acb.GenerationOutput:  # on the other loop, in another thread
                out: dict[str, acb.GenerationOutput] = {}

                async def result() -> None:
                    out["r"] = await h.result()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(result)
                    await anyio.wait_all_tasks_blocked()  # result() waits: the engine calls this loop now
                    waiting.set()
                    thaw.wait(HANG_GUARD)  # this loop's thread stalls, with what is posted to it queued
                return out["r"]

            other: dict[str, acb.GenerationOutput] = {}

            async def elsewhere() -> None:
                other["out"] = await anyio.to_thread.run_sync(
                    lambda: anyio.run(there, backend=other_backend(anyio_backend))
                )

            tokens: list[int] = []

            async def stream() -> None:
                tokens.extend([t async for d in h for t in d.token_ids])

            async with anyio.create_task_group() as tg:
                tg.start_soon(elsewhere)
                await anyio.to_thread.run_sync(waiting.wait, HANG_GUARD)
                try:
                    gate.allow(2)  # the prefill and one decode step: both posted to the stalled loop
                    await anyio.to_thread.run_sync(gate.wait_started, 3)
                    async with anyio.create_task_group() as streaming:
                        streaming.start_soon(stream)
                        await anyio.wait_all_tasks_blocked()  # the stream waits here: later steps come here
                        gate.open()
                finally:
                    thaw.set()
            here = await h.result()
        finally:
            gate.remove()
    assert other["out"] is here and here.generated_tokens == ref
    assert tokens == ref


# ------------------------------------------------------------------ without a running loop


def test_submit_needs_a_running_event_loop():
    eng = engine()
    eng.start()
    try:
        with pytest.raises(RuntimeError, match="asyncio or trio"):
            eng.submit_nowait([5, 6])
    finally:
        eng.stop()


def test_handles_of_a_finished_trio_run_are_still_delivered():
    trio = pytest.importorskip("trio")
    sp = acb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = reference_generate(get_model("llama"), [5, 6, 7], 6)
    eng = engine()
    eng.start()
    try:
        h = trio.run(eng.submit, [5, 6, 7], sp)  # that run is over once the handle is back
        h2 = trio.run(eng.submit, [5, 6, 7], sp)
        out = trio.run(h.result)  # a later run
        out2 = asyncio.run(h2.result())  # or another library
    finally:
        trio.run(eng.shutdown)
    assert out.generated_tokens == out2.generated_tokens == ref
