"""Prefix caching through the engine: same outputs as without it, and less prefill."""

from __future__ import annotations

import asyncio

import acb
from tests.conftest import get_model, prompts_of_lengths

BS = 8


def _run(model, prompts, caching, **kw):
    cfg = acb.ContinuousBatchingConfig(page_size=BS, num_blocks=128, allow_block_sharing=caching, **kw)
    with acb.Engine(model, cfg) as eng:
        outs = []
        for wave in (prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]):  # 2nd wave can hit the 1st
            hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=10)) for p in wave]
            outs += [h.result(timeout=120) for h in hs]
        return outs, eng.stats


def test_outputs_equal_with_and_without_prefix_cache():
    model = get_model("llama")
    base = prompts_of_lengths([40], seed=50)[0]
    tails = prompts_of_lengths([1, 5, 8, 13], seed=51)
    prompts = [
        base[:16],
        base[:16] + tails[0],
        base[:24] + tails[1],
        base + tails[2],  # boundary and mid-block
        base[:16],
        base[:17],
        base[:8] + tails[3],
        base,  # exact repeats, one-past, fully cached
        base[:1],
        base[:7],
        base + tails[0],
        base[:24],
    ]
    with_cache, st_on = _run(model, prompts, True)
    without, st_off = _run(model, prompts, False)
    assert [o.generated_tokens for o in with_cache] == [o.generated_tokens for o in without]
    assert st_on.prefix_hits > 0 and st_off.prefix_hits == 0
    assert st_on.prefill_tokens < st_off.prefill_tokens
    assert sum(o.num_cached_tokens for o in with_cache) == st_on.prefix_hits


def test_second_identical_request_prefills_only_its_tail():
    model = get_model("qwen3")
    cfg = acb.ContinuousBatchingConfig(page_size=BS, num_blocks=64)
    for n in (37, 40):  # mid-block and block-aligned prompts
        prompt = prompts_of_lengths([n], seed=52)[0]
        with acb.Engine(model, cfg) as eng:
            first = eng.generate(prompt, acb.SamplingParams(max_new_tokens=6))
            before = eng.stats.prefill_tokens
            second = eng.generate(prompt, acb.SamplingParams(max_new_tokens=6))
            recomputed = eng.stats.prefill_tokens - before
        assert second.generated_tokens == first.generated_tokens
        cached = (n - 1) // BS * BS
        assert second.num_cached_tokens == cached and recomputed == n - cached
        assert recomputed == (1 if n % BS == 1 else (n % BS or BS))


def test_cache_salt_isolates_and_reset_forgets():
    model = get_model("llama")
    prompt = prompts_of_lengths([33], seed=53)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=BS, num_blocks=64)) as eng:
        eng.generate(prompt, acb.SamplingParams(max_new_tokens=2), cache_salt="tenant-a")
        assert eng.generate(prompt, acb.SamplingParams(max_new_tokens=2), cache_salt="tenant-b").num_cached_tokens == 0
        assert eng.generate(prompt, acb.SamplingParams(max_new_tokens=2), cache_salt="tenant-a").num_cached_tokens == 32
        # reset while a request is running: it finishes normally, and nothing is found afterwards
        h = eng.submit(prompt, acb.SamplingParams(max_new_tokens=40, ignore_eos=True), cache_salt="tenant-a")
        forgotten = eng.reset_prefix_cache()
        assert forgotten > 0
        assert h.result(timeout=60).status == acb.RequestStatus.FINISHED
        eng.reset_prefix_cache()
        assert eng.generate(prompt, acb.SamplingParams(max_new_tokens=2), cache_salt="tenant-a").num_cached_tokens == 0


async def test_async_reset_prefix_cache():
    model = get_model("llama")
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=BS, num_blocks=64)) as eng:
        await eng.generate(list(range(3, 30)), acb.SamplingParams(max_new_tokens=2))
        assert await eng.reset_prefix_cache() >= 3
        await asyncio.sleep(0)


def test_evicted_prefix_blocks_are_counted_and_missed():
    model = get_model("llama")
    a, b = prompts_of_lengths([33, 33], seed=54)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=BS, num_blocks=7)) as eng:
        eng.generate(a, acb.SamplingParams(max_new_tokens=2))
        assert eng.stats.prefix_evictions == 0
        eng.generate(b, acb.SamplingParams(max_new_tokens=2))  # 6 usable blocks: b reuses a's cached ones
        assert eng.stats.prefix_evictions > 0
        assert eng.generate(a, acb.SamplingParams(max_new_tokens=2)).num_cached_tokens < 32
