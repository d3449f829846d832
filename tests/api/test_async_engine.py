"""AsyncEngine contracts: streams, results, cancellation, exactly one outcome per request.

Every test runs on both anyio backends, asyncio and trio (``anyio_backend``, tests/conftest.py).
"""

from __future__ import annotations

import functools
import threading

import anyio
import pytest

import acb
from acb.api import handles
from tests.conftest import HANG_GUARD, eventually, get_model, prompts_of_lengths, reference_generate

pytestmark = pytest.mark.anyio

CFG = dict(page_size=8, num_blocks=256)


def engine(**kw) -> acb.AsyncEngine:
    return acb.AsyncEngine(get_model("llama"), acb.ContinuousBatchingConfig(**{**CFG, **kw}))


def other_backend(backend: str) -> str:
    return {"asyncio": "trio", "trio": "asyncio"}[backend]


CONCURRENT_PROMPTS = prompts_of_lengths([3, 17, 40, 8, 25, 1, 12, 33, 19, 5] * 2, seed=10)


@functools.cache
def concurrent_refs() -> tuple[tuple[int, ...], ...]:
    # before any engine runs on the model (a running engine swaps its attention implementation);
    # cached for both backends
    model = get_model("llama")
    return tuple(tuple(reference_generate(model, p, 10)) for p in CONCURRENT_PROMPTS)


async def test_many_concurrent_streams_concatenate_to_result():
    refs = concurrent_refs()
    outs: dict[int, acb.GenerationOutput] = {}
    async with engine(max_batch_tokens=64) as eng:

        async def one(i, p):
            h = await eng.submit(p, acb.SamplingParams(max_new_tokens=10))
            got, finals = [], 0
            async for d in h:
                assert d.request_id == h.request_id
                got.extend(d.token_ids)
                finals += d.finished
            out = await h.result()
            assert finals == 1 and d.finished and d.output is out
            assert got == out.generated_tokens
            outs[i] = out

        async with anyio.create_task_group() as tg:  # a trio nursery under trio
            for i, p in enumerate(CONCURRENT_PROMPTS):
                tg.start_soon(one, i, p)
    assert len(outs) == len(CONCURRENT_PROMPTS)
    assert all(o.status == acb.RequestStatus.FINISHED for o in outs.values())
    assert [tuple(outs[i].generated_tokens) for i in range(len(CONCURRENT_PROMPTS))] == list(refs)
    assert outs[0].time_to_first_token is not None and outs[0].queue_time is not None


async def test_slow_consumer_gets_coalesced_deltas():
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=20, ignore_eos=True))
        await h.result()  # let the whole request finish before reading the stream
        deltas = [d async for d in h]
    assert len(deltas) == 1 and deltas[0].finished and len(deltas[0].token_ids) == 20


async def test_break_out_of_stream_cancels():
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        n = 0
        async for d in h:
            n += len(d.token_ids)
            if n >= 3:
                break
        with anyio.fail_after(30):
            out = await h.result()
    assert out.status == acb.RequestStatus.CANCELLED and out.finish_reason == acb.FinishReason.CANCELLED
    assert 3 <= len(out.generated_tokens) < 10_000


async def test_task_cancel_cancels_request():
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        seen = {"tokens": 0, "cancelled": False}

        async def consume():
            try:
                async for d in h:
                    seen["tokens"] += len(d.token_ids)
            except anyio.get_cancelled_exc_class():
                seen["cancelled"] = True
                raise

        # the consumer task is cancelled (asyncio: task.cancel(); trio: its nursery's cancel scope)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await eventually(lambda: seen["tokens"] > 0, "the consumer has read a token")
            tg.cancel_scope.cancel()
        assert seen["cancelled"] and seen["tokens"] > 0
        with anyio.fail_after(30):
            out = await h.result()
        assert out.status == acb.RequestStatus.CANCELLED
        # awaiting result() in a scope that gets cancelled also cancels
        h2 = await eng.submit([8, 9], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        held = threading.Event()
        eng.core.call(lambda c: held.wait(HANG_GUARD))  # h2 cannot end before the scope does
        with anyio.move_on_after(0.1) as scope:
            await h2.result()
        held.set()
        assert scope.cancelled_caught
        with anyio.fail_after(30):
            out2 = await h2.result()
        assert out2.status == acb.RequestStatus.CANCELLED and h2.done


async def test_handle_cancel_and_engine_cancel():
    async with engine() as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        h2 = await eng.submit([5, 6, 8], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        async for _ in h:
            h.cancel()
        assert eng.cancel(h2.request_id) is True
        o1, o2 = await h.result(), await h2.result()
        assert o1.status == o2.status == acb.RequestStatus.CANCELLED
        assert eng.cancel(h2.request_id) is False  # ended: a no-op that says so
        assert eng.cancel("never-existed") is False
        # the engine carries on
        out = await eng.generate([1, 2, 3], acb.SamplingParams(max_new_tokens=3))
        assert out.status == acb.RequestStatus.FINISHED


async def test_shutdown_cancels_pending_requests():
    eng = engine(max_requests_per_batch=2)
    eng.start()
    hs = [await eng.submit([5, 6, i + 3], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True)) for i in range(5)]
    await eventually(lambda: eng.stats.running == 2, "two requests run, three wait")
    await eng.shutdown()
    assert not eng.is_running  # shutdown returns once the engine thread has exited
    outs = [await h.result() for h in hs]
    assert all(o.status == acb.RequestStatus.CANCELLED for o in outs)
    with pytest.raises(acb.EngineNotRunningError):
        await eng.submit([1, 2])


async def test_shutdown_drain_finishes_requests():
    eng = engine()
    eng.start()
    hs = [await eng.submit([5, 6, i + 3], acb.SamplingParams(max_new_tokens=5)) for i in range(4)]
    await eng.shutdown(cancel_pending=False)
    outs = [await h.result() for h in hs]
    assert all(o.status == acb.RequestStatus.FINISHED for o in outs)


async def test_queue_limit_submit_waits_and_nowait_raises():
    async with engine(max_queue_size=2, max_requests_per_batch=1) as eng:
        long = acb.SamplingParams(max_new_tokens=300, ignore_eos=True)
        h0 = await eng.submit([5], long)
        await eventually(lambda: eng.stats.running == 1, "h0 is scheduled (leaves the queue)")
        h1 = eng.submit_nowait([6], long)
        h2 = eng.submit_nowait([7], long)
        with pytest.raises(acb.QueueFullError):
            eng.submit_nowait([8], long)
        # submit waits for a slot instead of failing
        got: list[acb.RequestHandle] = []
        admitted = anyio.Event()

        async def waiter():
            got.append(await eng.submit([9], acb.SamplingParams(max_new_tokens=2)))
            admitted.set()

        gate = threading.Event()
        eng.core.call(lambda c: gate.wait(HANG_GUARD))  # the engine is held: no slot can free up
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()  # the waiter is parked on the queue's gate
            assert not admitted.is_set()
            gate.set()
            with anyio.fail_after(HANG_GUARD):
                await admitted.wait()
        outs = [await h.result() for h in (h0, h1, h2, got[0])]
    assert [o.status for o in outs] == [acb.RequestStatus.FINISHED] * 4


async def test_handles_awaited_from_another_loop_thread(anyio_backend):
    # results are delivered to each request's own loop; the other thread runs the other library
    async with engine() as eng:
        h_main = await eng.submit([5, 6], acb.SamplingParams(max_new_tokens=4))

        def other_thread():
            async def run():
                h = await eng.submit([7, 8], acb.SamplingParams(max_new_tokens=4))
                return [d async for d in h][-1].output

            return anyio.run(run, backend=other_backend(anyio_backend))

        out_other = await anyio.to_thread.run_sync(other_thread)
        out_main = await h_main.result()
    assert out_other.status == out_main.status == acb.RequestStatus.FINISHED
    assert len(out_other.generated_tokens) == 4


async def test_timestamps_and_logprobs():
    async with engine(return_logprobs=True) as eng:
        out = await eng.generate(
            [5, 6, 7], acb.SamplingParams(max_new_tokens=6, ignore_eos=True), record_timestamps=True
        )
    assert len(out.timestamps) == 6 and out.timestamps == sorted(out.timestamps)
    assert len(out.logprobs) == 6 and all(lp <= 0 for lp in out.logprobs)


async def test_one_loop_callback_per_step(anyio_backend, monkeypatch):
    # the thread-safe call into the consumer's loop: asyncio's loop.call_soon_threadsafe, or
    # TrioToken.run_sync_soon behind _TrioLoop.call_soon_threadsafe
    loop = handles.current_loop()
    calls = {"n": 0}
    real = type(loop).call_soon_threadsafe

    def counting(self, *a, **k):
        if self is loop:
            calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(type(loop), "call_soon_threadsafe", counting)
    async with engine() as eng:
        hs = [
            await eng.submit([5, 6, i + 3], acb.SamplingParams(max_new_tokens=12, ignore_eos=True)) for i in range(16)
        ]
        outs = [await h.result() for h in hs]
    steps = eng.stats.steps  # final once the engine has stopped
    monkeypatch.undo()
    # 16 requests x 12 tokens = 192 deliveries, but at most one loop callback per engine step
    # (+1: on asyncio, shutdown's worker thread reports back through the same call)
    assert eng.stats.generated_tokens == 192 and all(len(o.generated_tokens) == 12 for o in outs)
    assert 0 < calls["n"] <= steps + 1, (calls["n"], steps)


def _thread_cpu_ticks(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # about the engine thread, not the loop
async def test_engine_thread_sleeps_when_idle():
    async with engine() as eng:
        await eng.generate([5, 6], acb.SamplingParams(max_new_tokens=2))
        tid = eng.core.thread.native_id
        before = _thread_cpu_ticks(tid)
        await anyio.sleep(1.0)
        after = _thread_cpu_ticks(tid)
        # a busy-spinning thread would burn ~100 ticks (1 s) here
        assert after - before <= 2
        # and it wakes up for new work
        with anyio.fail_after(10):
            out = await eng.generate([7, 8], acb.SamplingParams(max_new_tokens=2))
        assert out.status == acb.RequestStatus.FINISHED
