"""n > 1: one submit, the prompt prefilled once, samples sharing its KV blocks (copy-on-write)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import acb
from tests.conftest import get_model, prompts_of_lengths


def _hf_greedy(model, prompt, n, **kw):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("prompt_len", [13, 16])  # partial last block (copy-on-write) and block-aligned
def test_greedy_samples_equal_generate_and_prefill_once(prompt_len):
    model = get_model("llama")
    prompt = prompts_of_lengths([prompt_len], seed=40)[0]
    ref = _hf_greedy(model, prompt, 10, repetition_penalty=1.2)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        out = eng.generate(prompt, acb.SamplingParams(n=4, max_new_tokens=10, repetition_penalty=1.2))
        stats = eng.stats
    assert out.status == acb.RequestStatus.FINISHED and len(out.samples) == 4
    for s in out.samples:
        assert s.generated_tokens == ref, f"sample {s.index} decoded from a wrong KV cache"
    assert out.generated_tokens == ref
    assert stats.prefill_tokens == prompt_len  # the prompt went through the model once


def test_sampled_samples_differ_and_sample_zero_matches_seed():
    model = get_model("llama")
    prompt = prompts_of_lengths([21], seed=41)[0]
    sp = acb.SamplingParams(n=5, max_new_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        out = eng.generate(prompt, sp)
        single = eng.generate(prompt, acb.SamplingParams(max_new_tokens=16, temperature=1.0, seed=77, ignore_eos=True))
        again = eng.generate(prompt, sp)
        # prefilled once per submit; the 2nd and 3rd reuse the 2 full cached blocks (16 tokens)
        assert eng.stats.prefill_tokens == 21 + 2 * (21 - 16) and eng.stats.prefix_hits == 32
    samples = [s.generated_tokens for s in out.samples]
    assert len({tuple(s) for s in samples}) > 1, "samples should differ"
    assert samples[0] == single.generated_tokens
    assert [s.generated_tokens for s in again.samples] == samples  # reproducible with the seed


async def test_stream_and_cancel_groups():
    model = get_model("llama")
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        h = await eng.submit(
            [5, 6, 7, 8, 9], acb.SamplingParams(n=3, max_new_tokens=7, temperature=0.9, ignore_eos=True, logprobs=0)
        )
        per = {0: [], 1: [], 2: []}
        lps = {0: [], 1: [], 2: []}
        async for d in h:
            per[d.sample_index] += d.token_ids
            lps[d.sample_index] += d.logprobs or []
        out = await h.result()
        for s in out.samples:
            assert per[s.index] == s.generated_tokens and len(s.generated_tokens) == 7
            assert lps[s.index] == s.logprobs
        h2 = await eng.submit([5, 6, 7], acb.SamplingParams(n=4, max_new_tokens=10_000, ignore_eos=True))
        async for _ in h2:
            break
        out2 = await asyncio.wait_for(h2.result(), 30)
        assert out2.status == acb.RequestStatus.CANCELLED
        assert all(s.status == acb.RequestStatus.CANCELLED for s in out2.samples)
        # a sample's internal id is taken while the group lives
        hx = await eng.submit([1, 2], acb.SamplingParams(n=2, max_new_tokens=3), request_id="x")
        with pytest.raises(ValueError, match="already used"):
            await eng.submit([1, 2], request_id="x#1")
        assert len((await hx.result()).samples) == 2


def test_groups_under_preemption():
    model = get_model("qwen2")
    prompts = prompts_of_lengths([11, 14, 9], seed=42)
    refs = [_hf_greedy(model, p, 14) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(page_size=4, num_blocks=30, safety_margin=0.0)
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, acb.SamplingParams(n=3, max_new_tokens=14)) for p in prompts]
        outs = [h.result(timeout=120) for h in hs]
        assert eng.stats.preemptions > 0
    for out, ref in zip(outs, refs):
        assert [s.generated_tokens for s in out.samples] == [ref] * 3
