"""The blocking facade, generate_batch and the transformers-compatible manager."""

from __future__ import annotations

import asyncio
import threading

import pytest

import acb
from tests.conftest import HANG_GUARD, get_model, prompts_of_lengths, reference_generate

CFG = dict(page_size=8, num_blocks=128)


def test_sync_engine_stream_and_break_cancels():
    model = get_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        h = eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=8))
        got = []
        for d in h:
            got.extend(d.token_ids)
        out = h.result()
        assert got == out.generated_tokens and len(got) <= 8
        h2 = eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        for _d in h2:
            break
        assert h2.result(timeout=30).status == acb.RequestStatus.CANCELLED


def test_generate_batch_inside_running_event_loop():
    model = get_model("llama")
    prompts = prompts_of_lengths([4, 9, 13], seed=20)
    refs = [reference_generate(model, p, 5) for p in prompts]

    async def main():
        # a Jupyter cell: a loop is running in this thread, and generate_batch just works
        return acb.generate_batch(
            model,
            prompts,
            max_new_tokens=5,
            progress_bar=True,
            continuous_batching_config=acb.ContinuousBatchingConfig(**CFG),
        )

    res = asyncio.run(main())
    assert [o.generated_tokens for o in res.values()] == refs


def test_generate_batch_record_timestamps_and_empty():
    model = get_model("llama")
    assert acb.generate_batch(model, [], progress_bar=False) == {}
    res = acb.generate_batch(
        model,
        [[5, 6]],
        max_new_tokens=3,
        record_timestamps=True,
        progress_bar=False,
        sampling=acb.SamplingParams(ignore_eos=True),
    )
    assert len(res["req_0"].timestamps) == 3
    with pytest.raises(ValueError, match="empty"):
        acb.generate_batch(model, [[5], []], progress_bar=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        acb.generate_batch(model, [[5]], progress_bar=False, bogus=1)


def test_generate_batch_uses_generation_config():
    from transformers import GenerationConfig

    model = get_model("llama")
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
    res = acb.generate_batch(model, [[5, 6, 7]], generation_config=gc, progress_bar=False)
    assert len(res["req_0"].generated_tokens) == 4


def test_manager_api():
    model = get_model("llama")
    prompts = prompts_of_lengths([5, 11, 3], seed=21)
    refs = [reference_generate(model, p, 6) for p in prompts]
    manager = acb.init_continuous_batching(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    manager.warmup()
    manager.start()
    assert manager.is_running()
    ids = manager.add_requests(prompts, max_new_tokens=6)
    assert ids == ["req_0", "req_1", "req_2"]
    results = {}
    while len(results) < 3:
        out = manager.get_result(timeout=30)
        assert out is not None
        results[out.request_id] = out
    assert [results[i].generated_tokens for i in ids] == refs
    # streaming: partial outputs with all tokens so far, then the final one
    rid = manager.add_request(prompts[0], max_new_tokens=6, streaming=True)
    outs = list(manager.request_id_iter(rid))
    assert outs[-1].is_finished() and outs[-1].generated_tokens == refs[0]
    assert [len(o.generated_tokens) for o in outs[:-1]] == list(range(1, len(outs)))
    # cancel: unknown id is a no-op; a live one ends CANCELLED
    manager.cancel_request("nope")
    rid = manager.add_request([5, 6], max_new_tokens=10_000, eos_token_id=-1)
    manager.cancel_request(rid)
    out = manager.get_result(request_id=rid, timeout=30)
    assert out.status == acb.RequestStatus.CANCELLED
    manager.stop(block=True)
    assert not manager.is_running()
    assert manager.get_result(timeout=0.1) is None


def test_manager_restart_frees_the_stopped_engines_cache():
    """A stopped manager starts again with a fresh cache, and the first one's KV tensors are
    gone (the stopped engine core still holds its runner): on a GPU the second start would
    otherwise size its cache from what the dead one left free."""
    import gc
    import weakref

    model = get_model("llama")
    prompts = prompts_of_lengths([5, 11], seed=22)
    refs = [reference_generate(model, p, 5) for p in prompts]
    manager = acb.ContinuousBatchingManager(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    first_cache = None
    for _ in range(2):
        manager.start()
        runner = manager.engine.runner
        if first_cache is None:
            first_cache = weakref.ref(runner.kv_cache.k[0])
        else:
            assert runner.kv_cache.k[0] is not first_cache()
        ids = manager.add_requests(prompts, max_new_tokens=5, eos_token_id=-1)
        outs = {}
        while len(outs) < len(ids):
            out = manager.get_result(timeout=30)
            outs[out.request_id] = out
        assert [outs[i].generated_tokens for i in ids] == refs
        manager.stop(block=True)
        del runner
        gc.collect()
        assert first_cache() is None  # freed at the first stop, not kept by the stopped core


async def test_manager_result_handler():
    model = get_model("llama")
    manager = acb.ContinuousBatchingManager(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    manager.start()
    try:
        done = asyncio.Event()
        seen = []
        loop_thread = threading.get_ident()

        def cb(out):
            assert threading.get_ident() == loop_thread
            seen.append(out)
            if out.is_finished():
                done.set()

        rid = manager.add_request([5, 6, 7], max_new_tokens=4, streaming=True)
        manager.register_result_handler(rid, cb)
        await asyncio.wait_for(done.wait(), 30)
        assert seen[-1].is_finished() and len(seen[-1].generated_tokens) <= 4
    finally:
        manager.stop()


def test_manager_result_handler_under_trio():
    trio = pytest.importorskip("trio")
    model = get_model("llama")
    manager = acb.ContinuousBatchingManager(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    manager.start()
    seen = []

    async def main():
        done = trio.Event()
        run_thread = threading.get_ident()

        def cb(out):
            assert threading.get_ident() == run_thread  # called on the trio run, not the engine thread
            seen.append(out)
            if out.is_finished():
                done.set()

        rid = manager.add_request([5, 6, 7], max_new_tokens=4, streaming=True)
        manager.register_result_handler(rid, cb)
        with trio.fail_after(30):
            await done.wait()

    try:
        trio.run(main)
    finally:
        manager.stop()
    assert seen and seen[-1].is_finished() and len(seen[-1].generated_tokens) <= 4


def test_manager_stop_flushes_pending():
    model = get_model("llama")
    manager = acb.ContinuousBatchingManager(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    manager.start()
    ids = manager.add_requests([[5, 6], [7, 8, 9]], max_new_tokens=5)
    manager.stop(block=True)  # finishes what was added
    outs = [manager.get_result(i, timeout=HANG_GUARD) for i in ids]  # (they are out already: a hang-guard)
    assert all(o is not None and o.status == acb.RequestStatus.FINISHED for o in outs)


def test_manager_num_return_sequences():
    from transformers import GenerationConfig

    model = get_model("llama")
    gc = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.0, num_return_sequences=3, eos_token_id=-1)
    m = acb.ContinuousBatchingManager(model, gc, acb.ContinuousBatchingConfig(**CFG))
    m.start()
    try:
        rid = m.add_request([5, 6, 7])
        out = m.get_result(rid, timeout=30)
        assert len(out.samples) == 3 and all(len(s.generated_tokens) == 4 for s in out.samples)
        with pytest.raises(ValueError, match="num_return_sequences"):
            m.add_request([5, 6, 7], streaming=True)
    finally:
        m.stop()


@pytest.mark.parametrize("async_batching,offload", [(False, 0.0), (True, 0.0), (True, 0.01)])
def test_generate_batch_callback_per_prompt_sampling_and_stop(async_batching, offload):
    """``on_result`` sees every output once, as it ends, with its input index; ``sampling`` may be
    one per prompt; ``should_stop`` ends the batch early with every started request's final
    output (finished or cancelled), the unsubmitted ones left out and nothing left live. A
    ``num_blocks`` small enough to preempt, with and without offload."""
    model = get_model("llama")
    prompts = prompts_of_lengths([5, 11, 3, 17, 8, 6], seed=31)
    lengths = [3, 7, 1, 5, 4, 2]
    refs = [reference_generate(model, p, k) for p, k in zip(prompts, lengths)]
    # two waiting requests at most: generate_batch takes queue slots as they free up
    cfg = acb.ContinuousBatchingConfig(
        page_size=4,
        num_blocks=12,
        max_batch_tokens=16,
        max_queue_size=2,
        use_async_batching=async_batching,
        cpu_offload_space=offload,
    )
    with acb.Engine(model, cfg) as eng:
        seen: list[tuple[int, acb.GenerationOutput]] = []
        res = eng.generate_batch(
            prompts,
            [acb.SamplingParams(max_new_tokens=k) for k in lengths],
            progress_bar=False,
            on_result=lambda i, out: seen.append((i, out)),
        )
        assert [o.generated_tokens for o in res.values()] == refs
        assert sorted(i for i, _ in seen) == list(range(len(prompts)))
        assert all(res[f"req_{i}"] is out for i, out in seen)
        with pytest.raises(ValueError, match="2 SamplingParams for 6 inputs"):
            eng.generate_batch(prompts, [acb.SamplingParams()] * 2, progress_bar=False)

        # stop after the first result: the rest are cancelled or never submitted
        many = prompts_of_lengths([4] * 40, seed=32)
        ended: list[int] = []
        res = eng.generate_batch(
            many,
            max_new_tokens=60,
            ignore_eos=True,
            progress_bar=False,
            on_result=lambda i, out: ended.append(i),
            should_stop=lambda: bool(ended),
        )
        assert 1 <= len(res) < len(many) and sorted(ended) == sorted(int(k[4:]) for k in res)
        statuses = {o.status for o in res.values()}
        assert statuses <= {acb.RequestStatus.FINISHED, acb.RequestStatus.CANCELLED}
        assert acb.RequestStatus.CANCELLED in statuses
        assert not any(eng.ids.is_live(f"req_{i}") for i in range(len(many)))
        # the engine outlives it: the same ids run again
        again = eng.generate_batch(prompts[:2], max_new_tokens=3, progress_bar=False)
        assert [o.generated_tokens for o in again.values()] == [
            r[:3] for r in [reference_generate(model, p, 3) for p in prompts[:2]]
        ]
