"""Regression tests for defects found by a demanding user (issue 11), one or more per defect,
and for the promises the README makes about handles, nesting, prompts and stats."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

import acb
from acb.core.block_pool import BlockPool, SwapSpace
from acb.core.request import Request
from acb.core.scheduler import Scheduler
from acb.models import build_tokenizer, tiny_model
from acb.outputs import RequestStatus
from tests.conftest import eventually, get_model, prompts_of_lengths, reference_generate, wait_until


@pytest.fixture
def model():
    return get_model("llama")


def random_workload(seed: int, n: int, max_prompt: int, max_new: int):
    rng = random.Random(seed)
    prompts = prompts_of_lengths([rng.randint(1, max_prompt) for _ in range(n)], seed=seed)
    return prompts, [rng.randint(1, max_new) for _ in range(n)]


def run_gated(model, cfg, prompts, news):
    """Submit everything while the engine is held, so the first step sees the whole batch."""
    with acb.Engine(model, cfg) as eng:
        gate = threading.Event()
        eng.call(lambda c: gate.wait(30))
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=k, ignore_eos=True)) for p, k in zip(prompts, news)]
        gate.set()
        outs = [h.result(timeout=300) for h in hs]
        return outs, eng.stats


def refs_of(model, prompts, news):
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=k,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p, k in zip(prompts, news)
        ]


# ------------------------------------------------------------------ defect 1


def test_async_preemption_with_last_tokens_in_flight(model):
    # the shape of the report (async batching, a cache that forces preemption, lengths that end
    # at every step), scaled down
    prompts, news = random_workload(11, 40, 40, 40)
    cfg = acb.ContinuousBatchingConfig(
        use_async_batching=True,
        num_blocks=12,
        max_batch_tokens=64,
        page_size=8,
        max_requests_per_batch=8,
        safety_margin=0.0,
    )
    outs, stats = run_gated(model, cfg, prompts, news)
    assert stats.preemptions > 0 and stats.failed == 0
    assert [o.generated_tokens for o in outs] == refs_of(model, prompts, news)


def _async_step(s: Scheduler, inflight, sampled_token: int = 9):
    """Schedule the next step, then record the one in flight (the async engine's order)."""
    out = s.schedule()
    if inflight is not None:
        s.update_from_output(inflight, [sampled_token] * len(inflight.sample_reqs), None)
    return out


def test_request_preempted_with_a_token_in_flight_stays_queued_and_can_be_cancelled():
    s = Scheduler(BlockPool(4, enable_caching=False), block_size=4, max_batch_tokens=32, max_running=4)
    a = Request("a", [3, 4, 5], max_new_tokens=10)
    b = Request("b", [6, 7, 8], max_new_tokens=10)
    s.add(a)
    s.add(b)
    step0 = _async_step(s, None)  # both prefill one block each and sample
    step1 = _async_step(s, step0)  # both decode position 3 (placeholders), still in their first block
    step2 = s.schedule()  # position 4: a takes the last free block, b must give its own back
    assert step2.requests == [a] and b.status == RequestStatus.PENDING and b in s.waiting
    assert b.in_flight == 1  # the token b sampled in step 1 is still in flight
    s.update_from_output(step1, [9, 9], None)
    assert b.in_flight == 0 and b.status == RequestStatus.PENDING  # it landed; b is still queued, not running
    assert s.cancel("b") is b and b not in s.waiting and "b" not in s.live


# ------------------------------------------------------------------ defect 2


def test_offload_decided_by_a_step_that_runs_nothing_is_carried_to_the_next():
    # a's last token is in flight; b needs a block, none is free, and the only request it may
    # take one from is itself: it is offloaded and nothing runs in that step
    s = Scheduler(
        BlockPool(3, enable_caching=False), block_size=4, max_batch_tokens=32, max_running=4, swap=SwapSpace(8)
    )
    a = Request("a", [3, 4, 5], max_new_tokens=2)
    b = Request("b", [6, 7, 8], max_new_tokens=10)
    s.add(a)
    s.add(b)
    step0 = _async_step(s, None)
    step1 = _async_step(s, step0)  # a's second (last) token and b's second are in flight
    b_block = b.block_ids[0]
    assert _async_step(s, step1) is None  # b was offloaded; nothing ran
    assert b.swapped is not None and a.status == RequestStatus.FINISHED
    nxt = s.schedule()
    # the offload runs with the next step that runs, before its swap-in reads the host block back
    assert nxt.swap_out == [(b_block, 0)] and nxt.swap_in and nxt.swap_in[0][0] == 0
    assert nxt.requests == [b]


@pytest.mark.parametrize("async_batching", [True, False])
def test_offloaded_request_resumes_with_its_own_kv(model, async_batching):
    # two usable blocks of 8: a (older) ends after 2 tokens; b needs a second block at position 8
    # while a's last token is in flight, so b offloads itself in a step that runs nothing else
    a, b = prompts_of_lengths([5, 7], seed=15)
    cfg = acb.ContinuousBatchingConfig(
        use_async_batching=async_batching, num_blocks=3, page_size=8, cpu_offload_space=0.001, safety_margin=0.0
    )
    outs, stats = run_gated(model, cfg, [a, b], [2, 9])
    if async_batching:
        assert stats.swapped_out_blocks == stats.swapped_in_blocks == 1
    assert [o.generated_tokens for o in outs] == refs_of(model, [a, b], [2, 9])


# -------------------------------------------------------------- defects 3-7


async def test_submit_time_limits(model):
    cfg = acb.ContinuousBatchingConfig(page_size=16, num_blocks=8, max_requests_per_batch=16)
    prompt = prompts_of_lengths([37], seed=13)[0]
    async with acb.AsyncEngine(model, cfg) as eng:
        bystander = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=6, min_new_tokens=3))
        with pytest.raises(ValueError, match="n=17 .* max_requests_per_batch is 16"):  # defect 3
            await eng.submit([5, 6], acb.SamplingParams(n=17))
        with pytest.raises(ValueError, match="can never fit: forking them needs 10 KV blocks"):  # defect 4
            await eng.submit(prompt, acb.SamplingParams(n=8))
        with pytest.raises(ValueError, match="stop_token_ids token id 300 is outside"):  # defect 5
            await eng.submit([5, 6], acb.SamplingParams(stop_token_ids=(2, 300), min_new_tokens=3))
        for salt in (b"tenant", 5):  # defect 7: refused before the id is claimed
            with pytest.raises(TypeError, match="cache_salt must be a str"):
                await eng.submit([5, 6], request_id="mine", cache_salt=salt)
        with pytest.raises(TypeError, match="request_id must be a str"):
            await eng.submit([5, 6], request_id=7)
        mine = await eng.generate([5, 6], acb.SamplingParams(max_new_tokens=3), request_id="mine", cache_salt="t")
        two = await eng.generate(prompt, acb.SamplingParams(n=2, max_new_tokens=5, ignore_eos=True))
        out = await bystander.result()
        assert eng.stats.failed == 0
    assert mine.status == out.status == two.status == acb.RequestStatus.FINISHED
    ref = reference_generate(model, prompt, 5)
    assert [s.generated_tokens for s in two.samples] == [ref, ref]


async def test_logprobs_beyond_a_small_vocabulary_refused():  # defect 6
    small = tiny_model("llama", vocab_size=8)
    async with acb.AsyncEngine(small, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16)) as eng:
        with pytest.raises(ValueError, match="logprobs=20 asks for more alternatives than the vocabulary's 8"):
            await eng.submit([3, 4], acb.SamplingParams(logprobs=20))
        out = await eng.generate([3, 4], acb.SamplingParams(logprobs=8, max_new_tokens=3, ignore_eos=True))
    assert len(out.top_logprobs) == 3 and all(len(t) == 8 for t in out.top_logprobs)


def test_generation_config_stop_ids_outside_the_vocabulary_are_ignored(model):
    gc = model.generation_config.__class__(eos_token_id=[2, 999], max_new_tokens=6)
    prompt = [5, 6, 7]
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16), gc) as eng:
        out = eng.generate(prompt, acb.SamplingParams(min_new_tokens=2))
    assert out.status == acb.RequestStatus.FINISHED
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            min_new_tokens=2,
            do_sample=False,
            eos_token_id=[2],
            pad_token_id=0,
        )[0, 3:].tolist()
    assert out.generated_tokens == [t for t in ref if t != 0][: len(out.generated_tokens)]


# ------------------------------------------------------------------ defect 8


@pytest.mark.parametrize("stop_first", ["a", "b"])
def test_two_engines_on_one_model(model, stop_first):
    prompts = prompts_of_lengths([9, 17, 4], seed=14)
    refs = [reference_generate(model, p, 10) for p in prompts]
    own = model.config._attn_implementation
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)
    a, b = acb.Engine(model, cfg), acb.Engine(model, cfg)
    a.start()
    b.start()
    try:
        sp = acb.SamplingParams(max_new_tokens=10)
        ha = [a.submit(p, sp) for p in prompts]
        hb = [b.submit(p, sp) for p in prompts]
        assert [h.result(timeout=60).generated_tokens for h in ha + hb] == refs + refs
        first, second = (a, b) if stop_first == "a" else (b, a)
        first.shutdown()
        assert model.config._attn_implementation == "acb_paged"  # still in use by the other
        assert [second.generate(p, sp).generated_tokens for p in prompts] == refs
        second.shutdown()
    finally:
        a.shutdown()
        b.shutdown()
    assert model.config._attn_implementation == own
    assert reference_generate(model, prompts[0], 10) == refs[0]


# ------------------------------------------------------------------ defect 9


class BrokenDecode:
    """A tokenizer whose decode raises (after ``ok`` successful calls)."""

    def __init__(self, ok: int = 0) -> None:
        self.tok = build_tokenizer()
        self.ok = ok

    def decode(self, ids, **kw):
        if self.ok <= 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken tokenizer")
        self.ok -= 1
        return self.tok.decode(ids, **kw)


async def test_failing_decode_fails_only_its_request(model):
    async with acb.AsyncEngine(
        model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32), tokenizer=BrokenDecode(ok=2)
    ) as eng:
        other = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=8, ignore_eos=True))
        bad = await eng.submit([8, 9], acb.SamplingParams(max_new_tokens=8, stop=["zz"], ignore_eos=False))
        with pytest.raises(
            acb.RequestFailedError, match=r"UnicodeDecodeError in the output checks \(stop strings, grammar\)"
        ) as err:
            await asyncio.wait_for(bad.result(), 30)
        # the partial output is attached (the text decoder shares the tokenizer's budget of good calls)
        assert 1 <= len(err.value.output.generated_tokens) < 8
        out = await asyncio.wait_for(other.result(), 30)
        assert eng.is_running and eng.stats.failed == 1
    assert out.generated_tokens == reference_generate(model, [5, 6, 7], 8)


async def test_engine_death_reaches_every_handle_even_if_decoding_fails(model, monkeypatch):
    eng = acb.AsyncEngine(
        model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32), tokenizer=BrokenDecode(ok=1_000_000)
    )
    eng.start()
    core = eng.core
    hs = [await eng.submit([5, 6, i + 3], acb.SamplingParams(max_new_tokens=10_000, stop=["zz"])) for i in range(3)]
    await eventually(
        lambda: len(core.scheduler.running) == 3 and all(r.num_generated for r in list(core.scheduler.running)),
        "the three requests run and have sampled",
    )

    def broken(*a, **k):
        eng.tokenizer.ok = 0  # building the failed outputs must not need the tokenizer
        raise AssertionError("scheduler bug")

    monkeypatch.setattr(core.scheduler, "schedule", broken)
    for h in hs:
        with pytest.raises(acb.EngineDeadError):
            await asyncio.wait_for(h.result(), 30)
    assert core.pool.num_used == 0 and not eng.ids.live  # a dead engine holds nothing


def test_a_raising_result_callback_does_not_stop_the_engine(model, caplog):
    manager = acb.init_continuous_batching(
        model, continuous_batching_config=acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)
    )
    manager.start()
    router_put = manager.output_router.put
    try:

        def broken(out):
            raise RuntimeError("callback bug")

        manager.output_router.put = broken  # the result callback of the next request raises
        manager.add_request([5, 6], max_new_tokens=3)
        wait_until(lambda: "callback bug" in caplog.text, "the raising callback is logged")
        manager.output_router.put = router_put
        rid = manager.add_request([5, 6], max_new_tokens=3)
        out = manager.get_result(rid, timeout=30)
        assert manager.is_running()
    finally:
        manager.stop(hard_stop=True)
    assert "callback bug" in caplog.text
    assert out is not None and out.generated_tokens == reference_generate(model, [5, 6], 3)


# ------------------------------------------------------------------ promises


async def test_handle_awaited_on_another_loop(model):
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)
    async with acb.AsyncEngine(model, cfg) as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=12, ignore_eos=True))
        h2 = await eng.submit([8, 9], acb.SamplingParams(max_new_tokens=12, ignore_eos=True))

        def other_loop():  # a different loop, in another thread, streams what this loop submitted
            async def read():
                return [d async for d in h]

            return asyncio.run(read())

        deltas = await asyncio.to_thread(other_loop)
        out = await h.result()
        assert sum((d.token_ids for d in deltas), []) == out.generated_tokens and deltas[-1].finished
        out2 = await asyncio.to_thread(lambda: asyncio.run(h2.result()))
    assert out.generated_tokens == reference_generate(model, [5, 6, 7], 12)
    assert out2.generated_tokens == reference_generate(model, [8, 9], 12)


def test_handle_submitted_on_a_closed_loop_is_still_delivered(model):
    eng = acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32))
    eng.start()
    try:
        h = asyncio.run(eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=6, ignore_eos=True)))
        out = asyncio.run(asyncio.wait_for(h.result(), 30))  # the submitting loop is closed by now
    finally:
        asyncio.run(eng.shutdown())
    assert out.generated_tokens == reference_generate(model, [5, 6, 7], 6)


async def test_nested_context_managers_share_the_engine(model):
    eng = acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32))
    async with eng:
        async with eng:
            assert (await eng.generate([5, 6], acb.SamplingParams(max_new_tokens=2))).generated_tokens
        assert eng.is_running
        assert len((await eng.generate([5, 6], acb.SamplingParams(max_new_tokens=2))).generated_tokens) == 2
    assert not eng.is_running
    sync = acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32))
    with sync:
        with sync:
            pass
        assert sync.generate([5], acb.SamplingParams(max_new_tokens=1)).status == acb.RequestStatus.FINISHED
    assert not sync.is_running


async def test_prompt_shapes(model):
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        with pytest.raises(TypeError, match="ordered sequence of token ids, got a dict"):
            await eng.submit({5: 1, 6: 1})
        with pytest.raises(TypeError, match="got a set"):
            await eng.submit({5, 6})
        with pytest.raises(ValueError, match=r"must be 1-D \(or \[1, T\]\), got shape \(2, 2\)"):
            await eng.submit(torch.tensor([[5, 6], [7, 8]]))
        one = await eng.generate(torch.tensor([[5, 6, 7]]), acb.SamplingParams(max_new_tokens=4))
    assert one.prompt_ids == [5, 6, 7] and one.generated_tokens == reference_generate(model, [5, 6, 7], 4)


def test_generate_batch_takes_a_2d_tensor(model):
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)
    batch = torch.tensor([[5, 6, 7], [9, 10, 11]])
    outs = acb.generate_batch(model, batch, continuous_batching_config=cfg, max_new_tokens=4, progress_bar=False)
    assert [o.generated_tokens for o in outs.values()] == [reference_generate(model, r, 4) for r in batch.tolist()]
    with pytest.raises(TypeError, match="inputs must be a list of prompts"):
        acb.generate_batch(model, {"a": [1]}, continuous_batching_config=cfg)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        acb.generate_batch(model, torch.tensor([5, 6]), continuous_batching_config=cfg)


def test_manager_prompt_and_eos_checks(model):
    manager = acb.init_continuous_batching(
        model, continuous_batching_config=acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)
    )
    manager.start()
    try:
        with pytest.raises(TypeError, match="eos_token_id must be an int or a list of ints, got 'x'"):
            manager.add_request([5, 6], eos_token_id="x")
        rid = manager.add_request(torch.tensor([5, 6, 7]), max_new_tokens=3, streaming=True)
        outs = list(manager.request_id_iter(rid))
    finally:
        manager.stop()
    assert all(o.prompt_ids == [5, 6, 7] and all(type(t) is int for t in o.prompt_ids) for o in outs)
    assert outs[-1].generated_tokens == reference_generate(model, [5, 6, 7], 3)


async def test_stats_count_every_result_already_delivered(model):
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        for k in range(1, 6):
            await eng.generate([5, 6, k + 3], acb.SamplingParams(max_new_tokens=k))
            st = eng.stats
            assert st.finished == k and st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0
