"""``SamplingParams(prompt_logprobs=k)``: every prompt token's logprob after the first, and the
top-k alternatives, exact against a full forward of the model (CPU float32), whole or chunked,
with a warm prefix cache (which such a request does not read), async batching, preemption."""

from __future__ import annotations

import pytest
import torch

import acb
from tests.conftest import get_model, prompts_of_lengths


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, V]`` log-softmax of the logits at positions 0..P-2."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check(model, prompt: list[int], out: acb.GenerationOutput, k: int) -> None:
    ref = _reference(model, prompt)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), want, atol=1e-5, rtol=0)
    assert out.prompt_top_logprobs is not None and len(out.prompt_top_logprobs) == len(prompt) - 1
    top = ref.topk(k, dim=-1)
    for i, alts in enumerate(out.prompt_top_logprobs):
        assert len(alts) == k
        torch.testing.assert_close(torch.tensor([lp for _, lp in alts]), top.values[i], atol=1e-5, rtol=0)
        # ids: equal, up to the order of exact ties
        assert {t for t, _ in alts} == set(top.indices[i].tolist()) or len({lp for _, lp in alts}) < k


@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_exact_whole_and_chunked(arch, async_batching):
    model = get_model(arch)
    prompts = prompts_of_lengths([2, 9, 40, 75], seed=41)
    # max_batch_tokens 16: the long prompts are prefilled in chunks, several per request
    cfg = acb.ContinuousBatchingConfig(
        page_size=8, num_blocks=64, max_batch_tokens=16, use_async_batching=async_batching
    )
    sp = acb.SamplingParams(max_new_tokens=3, prompt_logprobs=4, ignore_eos=True)
    res = acb.generate_batch(model, prompts, sampling=sp, continuous_batching_config=cfg, progress_bar=False)
    for p, out in zip(prompts, res.values()):
        _check(model, p, out, 4)


def test_prefix_cache_is_not_read_and_others_are_unaffected():
    model = get_model("llama")
    shared = prompts_of_lengths([32], seed=42)[0]
    prompt = shared + prompts_of_lengths([7], seed=43)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        warm = eng.generate(shared + [5, 6], acb.SamplingParams(max_new_tokens=2))
        out = eng.generate(prompt, acb.SamplingParams(max_new_tokens=2, prompt_logprobs=0))
        again = eng.generate(prompt, acb.SamplingParams(max_new_tokens=2))  # a plain request still hits
    assert warm.prompt_logprobs is None
    assert out.num_cached_tokens == 0  # computed, not read from the cache
    _check(model, prompt, out, 0)
    assert out.prompt_top_logprobs == [[] for _ in prompt[1:]]
    assert again.num_cached_tokens >= 32 and again.generated_tokens == out.generated_tokens


def test_preemption_recompute_gives_each_position_once():
    model = get_model("llama")
    prompts = prompts_of_lengths([40, 44, 38], seed=44)
    # 13 usable blocks of 8, no offload space: requests are preempted and recomputed
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=14, max_batch_tokens=24)
    sp = acb.SamplingParams(max_new_tokens=30, prompt_logprobs=2, ignore_eos=True)
    with acb.Engine(model, cfg) as eng:
        hs = [eng.submit(p, sp) for p in prompts]
        outs = [h.result() for h in hs]
        assert eng.stats.preemptions > 0
    for p, out in zip(prompts, outs):
        _check(model, p, out, 2)


def test_n_samples_and_validation():
    model = get_model("llama")
    prompt = prompts_of_lengths([12], seed=45)[0]
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=64)) as eng:
        out = eng.generate(
            prompt, acb.SamplingParams(max_new_tokens=4, n=3, temperature=1.0, seed=2, prompt_logprobs=1)
        )
        with pytest.raises(ValueError, match="prompt_logprobs must be <= 20"):
            eng.generate(prompt, acb.SamplingParams(prompt_logprobs=21))
    _check(model, prompt, out, 1)
    assert out.samples is not None and len(out.samples) == 3
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        acb.SamplingParams(prompt_logprobs=-1)
