"""Sampling through the engine: seeds, penalties, min_new_tokens, logprobs and stop strings vs transformers."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.models import build_tokenizer
from tests.conftest import get_model, prompts_of_lengths, reference_generate

CFG = dict(page_size=8, num_blocks=256)


def test_seeded_request_same_alone_batched_and_preempted():
    model = get_model("llama")
    prompt = prompts_of_lengths([11], seed=30)[0]
    seeded = acb.SamplingParams(max_new_tokens=24, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        alone = eng.generate(prompt, seeded).generated_tokens
        again = eng.generate(prompt, seeded).generated_tokens
        other_seed = eng.generate(
            prompt, acb.SamplingParams(max_new_tokens=24, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
        ).generated_tokens
    assert alone == again and alone != other_seed
    # in a batch of 32 with mixed parameters and lengths
    others = prompts_of_lengths([3 + 2 * i for i in range(31)], seed=31)
    mixed = [
        acb.SamplingParams(max_new_tokens=10 + i % 7, temperature=0.5 + (i % 3) * 0.4, top_p=0.9)
        if i % 2
        else acb.SamplingParams(max_new_tokens=12)
        for i in range(31)
    ]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG, max_batch_tokens=40)) as eng:
        hs = [eng.submit(p, sp) for p, sp in zip(others[:15], mixed[:15])]
        h = eng.submit(prompt, seeded)
        hs += [eng.submit(p, sp) for p, sp in zip(others[15:], mixed[15:])]
        batched = h.result(timeout=120).generated_tokens
        for x in hs:
            x.result(timeout=120)
    assert batched == alone
    # under forced preemption (a tiny cache)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=4, num_blocks=24, safety_margin=0.0)) as eng:
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=30, ignore_eos=True)) for p in others[20:28]]
        h = eng.submit(prompt, seeded)
        preempted = h.result(timeout=120)
        for x in hs:
            x.result(timeout=120)
        assert eng.stats.preemptions > 0
    assert preempted.generated_tokens == alone


def test_engine_seed_makes_unseeded_runs_repeatable():
    model = get_model("llama")
    sp = acb.SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        res = acb.generate_batch(
            model,
            [[5, 6, 7], [9, 10]],
            sampling=sp,
            progress_bar=False,
            continuous_batching_config=acb.ContinuousBatchingConfig(**CFG, seed=seed),
        )
        runs.append([o.generated_tokens for o in res.values()])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _hf(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            output_scores=True,
            **kw,
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_repetition_penalty_matches_generate(arch):
    model = get_model(arch)
    prompts = prompts_of_lengths([4, 15, 30], seed=32)
    refs = [_hf(model, p, max_new_tokens=16, repetition_penalty=1.4).sequences[0, len(p) :].tolist() for p in prompts]
    res = acb.generate_batch(
        model,
        prompts,
        sampling=acb.SamplingParams(max_new_tokens=16, repetition_penalty=1.4),
        continuous_batching_config=acb.ContinuousBatchingConfig(**CFG),
        progress_bar=False,
    )
    assert [o.generated_tokens for o in res.values()] == refs


def test_min_new_tokens_suppresses_eos_as_transformers():
    model = get_model("llama")
    prompt = prompts_of_lengths([9], seed=33)[0]
    free = reference_generate(model, prompt, 12)
    eos = free[1]  # make the 2nd greedy token the EOS: without min_new_tokens it stops there
    ref = _hf(model, prompt, max_new_tokens=12, min_new_tokens=6, eos_token_id=eos).sequences[0, len(prompt) :].tolist()
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        plain = eng.generate(prompt, acb.SamplingParams(max_new_tokens=12, stop_token_ids=(eos,)))
        held = eng.generate(prompt, acb.SamplingParams(max_new_tokens=12, stop_token_ids=(eos,), min_new_tokens=6))
    assert plain.generated_tokens == free[:2] and plain.finish_reason == acb.FinishReason.STOP
    assert held.generated_tokens == ref and len(held.generated_tokens) >= 6
    assert eos not in held.generated_tokens[:6]


def test_ignore_eos_ignores_the_models_eos_only():
    """As vLLM: ``ignore_eos`` runs through the generation config's EOS; explicit
    ``stop_token_ids`` and ``stop`` strings still end the request."""
    from transformers import GenerationConfig

    tok = build_tokenizer()
    model = get_model("llama", vocab_size=len(tok))
    prompt = prompts_of_lengths([9], seed=35, vocab=len(tok))[0]
    free = reference_generate(model, prompt, 24)
    eos = free[2]
    gc = GenerationConfig(eos_token_id=eos)  # the engine's default stop token: the 3rd greedy token
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG), gc, tokenizer=tok) as eng:
        stopped = eng.generate(prompt, acb.SamplingParams(max_new_tokens=24))
        ignored = eng.generate(prompt, acb.SamplingParams(max_new_tokens=24, ignore_eos=True))
        explicit = eng.generate(
            prompt, acb.SamplingParams(max_new_tokens=24, ignore_eos=True, stop_token_ids=[free[5]])
        )
        i = next(
            i
            for i in range(6, 24)
            if tok.decode(free[i : i + 1]).isascii() and tok.decode(free[i : i + 1]).isprintable()
        )
        stop = tok.decode(free[i : i + 1])
        text = eng.generate(prompt, acb.SamplingParams(max_new_tokens=24, ignore_eos=True, stop=[stop]))
    assert stopped.generated_tokens == free[: free.index(eos) + 1] and stopped.finish_reason == acb.FinishReason.STOP
    assert ignored.generated_tokens == free and ignored.finish_reason == acb.FinishReason.LENGTH
    assert explicit.generated_tokens == free[: free.index(free[5]) + 1]
    assert explicit.finish_reason == acb.FinishReason.STOP
    assert text.finish_reason == acb.FinishReason.STOP and stop not in text.text
    assert text.generated_tokens == free[: len(text.generated_tokens)] and len(text.generated_tokens) <= i + 1


def test_logprobs_match_model_logits():
    model = get_model("llama")
    prompt = prompts_of_lengths([13], seed=34)[0]
    hf = _hf(model, prompt, max_new_tokens=8, repetition_penalty=1.3)
    raw = torch.stack(hf.logits)[:, 0].float().log_softmax(-1)  # [steps, V]
    processed = torch.stack(hf.scores)[:, 0].float().log_softmax(-1)
    tokens = hf.sequences[0, len(prompt) :]
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        out_raw = eng.generate(prompt, acb.SamplingParams(max_new_tokens=8, repetition_penalty=1.3, logprobs=3))
        out_proc = eng.generate(
            prompt, acb.SamplingParams(max_new_tokens=8, repetition_penalty=1.3, logprobs=3, logprobs_mode="processed")
        )
    assert out_raw.generated_tokens == tokens.tolist() == out_proc.generated_tokens
    steps = torch.arange(len(tokens))
    torch.testing.assert_close(torch.tensor(out_raw.logprobs), raw[steps, tokens], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(out_proc.logprobs), processed[steps, tokens], atol=1e-4, rtol=1e-4)
    for i, alts in enumerate(out_raw.top_logprobs):
        top = raw[i].topk(3)
        assert [t for t, _ in alts] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in alts]), top.values, atol=1e-4, rtol=1e-4)


async def test_logprobs_in_stream_deltas():
    model = get_model("llama")
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        h = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=6, logprobs=2, ignore_eos=True))
        lps, tops = [], []
        async for d in h:
            lps += d.logprobs
            tops += d.top_logprobs
        out = await h.result()
    assert lps == out.logprobs and tops == out.top_logprobs and len(tops) == 6 and all(len(t) == 2 for t in tops)


def test_stop_strings_cut_text_keep_tokens():
    tok = build_tokenizer()
    model = acb.models.default_model()
    prompt = tok("The quick brown fox").input_ids
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=16, num_blocks=64), tokenizer=tok) as eng:
        free = eng.generate(prompt, acb.SamplingParams(max_new_tokens=40, ignore_eos=True))
        gen = free.generated_tokens
        text = tok.decode(gen)
        # three consecutive generated tokens that are printable ASCII characters
        start = next(
            i
            for i in range(3, len(gen) - 3)
            if all(tok.decode([t]).isascii() and tok.decode([t]).isprintable() for t in gen[i : i + 3])
        )
        stop = tok.decode(gen[start : start + 3])
        assert text.find(stop) >= 0
        out = eng.generate(prompt, acb.SamplingParams(max_new_tokens=40, stop=[stop, "never-appears"]))
    assert out.finish_reason == acb.FinishReason.STOP
    assert out.text == text[: text.find(stop)]
    # tokens are kept up to and including the one that completed the stop string
    n = len(out.generated_tokens)
    assert out.generated_tokens == free.generated_tokens[:n]
    assert stop in tok.decode(out.generated_tokens) and stop not in tok.decode(out.generated_tokens[:-1])


def test_manager_per_request_processors_and_return_logprobs():
    model = get_model("llama")
    prompt = [5, 6, 7, 8]
    ref = _hf(model, prompt, max_new_tokens=6, repetition_penalty=1.5)
    ref_tokens = ref.sequences[0, len(prompt) :].tolist()
    ref_lp = torch.stack(ref.scores)[:, 0].float().log_softmax(-1)  # processed, as transformers' return_logprobs
    cfg = acb.ContinuousBatchingConfig(**CFG, per_request_processors=True, return_logprobs=True)
    m = acb.ContinuousBatchingManager(model, continuous_batching_config=cfg)
    m.start()
    try:
        rid = m.add_request(prompt, max_new_tokens=6, repetition_penalty=1.5)
        out = m.get_result(rid, timeout=30)
        with pytest.raises(ValueError, match="typical_p"):
            m.add_request(prompt, typical_p=0.5)
    finally:
        m.stop()
    assert out.generated_tokens == ref_tokens
    idx = torch.arange(len(ref_tokens))
    torch.testing.assert_close(torch.tensor(out.logprobs), ref_lp[idx, torch.tensor(ref_tokens)], atol=1e-4, rtol=1e-4)
    # without per_request_processors, transformers' meaning: the kwargs are ignored (with a warning)
    m = acb.ContinuousBatchingManager(model, continuous_batching_config=acb.ContinuousBatchingConfig(**CFG))
    m.start()
    try:
        with pytest.warns(UserWarning, match="per_request_processors"):
            rid = m.add_request(prompt, max_new_tokens=6, repetition_penalty=1.5)
        plain = m.get_result(rid, timeout=30)
    finally:
        m.stop()
    assert plain.generated_tokens == reference_generate(model, prompt, 6)


def test_generation_config_processors():
    from transformers import GenerationConfig

    model = get_model("llama")
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, repetition_penalty=1.3, eos_token_id=-1)
    ref = _hf(model, [5, 6, 7], max_new_tokens=5, repetition_penalty=1.3).sequences[0, 3:].tolist()
    res = acb.generate_batch(
        model,
        [[5, 6, 7]],
        generation_config=gc,
        progress_bar=False,
        continuous_batching_config=acb.ContinuousBatchingConfig(**CFG),
    )
    assert res["req_0"].generated_tokens == ref
    # suppress_tokens (TRL sets a VLM's image token): the tokens generate would have picked, never picked
    suppress = ref[:2]
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, suppress_tokens=suppress, eos_token_id=-1)
    ref = _hf(model, [5, 6, 7], max_new_tokens=5, suppress_tokens=suppress).sequences[0, 3:].tolist()
    res = acb.generate_batch(
        model,
        [[5, 6, 7]],
        generation_config=gc,
        progress_bar=False,
        continuous_batching_config=acb.ContinuousBatchingConfig(**CFG),
    )
    assert res["req_0"].generated_tokens == ref and not set(ref) & set(suppress)
    with pytest.warns(UserWarning, match="typical_p"):
        acb.generate_batch(
            model,
            [[5]],
            generation_config=GenerationConfig(max_new_tokens=2, typical_p=0.5),
            progress_bar=False,
            continuous_batching_config=acb.ContinuousBatchingConfig(**CFG),
        )
    with pytest.raises(ValueError, match="typical_p"):
        acb.generate_batch(
            model,
            [[5]],
            generation_config=GenerationConfig(max_new_tokens=2, typical_p=0.5),
            progress_bar=False,
            continuous_batching_config=acb.ContinuousBatchingConfig(**CFG, drop_unsupported_processors=False),
        )


@pytest.mark.parametrize("async_batching", [False, True])
async def test_stop_strings_search_the_text_the_caller_gets(async_batching):
    """The text searched for stop strings is the caller's: decoded with the request's
    ``skip_special_tokens``. Issue 26 item 9: with special tokens skipped (the default) a stop
    string that a special token splits ('*<s>p' -> '*p') cut the stream but never ended the
    request, and ``output.text`` kept the special tokens while the deltas left them out."""
    tok = build_tokenizer()
    model = acb.models.default_model()
    prompt = tok("The quick brown fox").input_ids
    bias = {1: 6.0}  # <s> (special) comes up now and then among the generated bytes
    cfg = acb.ContinuousBatchingConfig(page_size=16, num_blocks=64, use_async_batching=async_batching)

    def printable(t: int) -> bool:
        s = tok.decode([t])
        return len(s) == 1 and s.isascii() and s.isprintable()

    async def run(eng, **kw):
        h = await eng.submit(prompt, max_new_tokens=30, ignore_eos=True, logit_bias=bias, **kw)
        pieces = [d.text or "" async for d in h]
        return await h.result(), "".join(pieces)

    async with acb.AsyncEngine(model, cfg, tokenizer=tok) as eng:
        free, _ = await run(eng)
        gen = free.generated_tokens
        i = next(i for i in range(1, len(gen) - 1) if gen[i] == 1 and printable(gen[i - 1]) and printable(gen[i + 1]))
        stop = tok.decode([gen[i - 1]]) + tok.decode([gen[i + 1]])
        shown = tok.decode(gen, skip_special_tokens=True)
        raw = tok.decode(gen, skip_special_tokens=False)
        assert stop in shown
        cut, cut_streamed = await run(eng, stop=[stop])
        kept, kept_streamed = await run(eng, stop=["never-appears"])
        raw_out, raw_streamed = await run(eng, stop=[stop], skip_special_tokens=False)
    # skipped specials: the request ends at the token that completes the stop string
    assert cut.finish_reason == acb.FinishReason.STOP
    assert cut.generated_tokens == gen[: len(cut.generated_tokens)] and len(cut.generated_tokens) <= i + 2
    assert cut.text == cut_streamed == shown[: shown.find(stop)]
    # no stop string matched: the output's text is the stream's, without the special tokens
    assert kept.finish_reason == acb.FinishReason.LENGTH
    assert kept.text == kept_streamed == shown
    # special tokens kept: '<s>' splits the stop string here, so it ends only where it appears whole
    want = raw.find(stop)
    assert raw_out.text == raw_streamed == (raw[:want] if want >= 0 else raw)
    assert (raw_out.finish_reason == acb.FinishReason.STOP) == (want >= 0)


@pytest.mark.parametrize("async_batching", [False, True])
def test_a_rows_logit_bias_does_not_outlive_its_request(async_batching):
    """Found by the stateful fuzz once it drew logit biases: a request that takes over the sampler
    row of a finished request with a logit bias ran with that bias whenever another row of the step
    had one (the bias table is added for every row then)."""
    model = get_model("llama")
    prompt = prompts_of_lengths([10], seed=36)[0]
    ref = reference_generate(model, prompt, 8)
    cfg = acb.ContinuousBatchingConfig(**CFG, max_requests_per_batch=2, use_async_batching=async_batching)
    with acb.Engine(model, cfg) as eng:
        import threading

        gate = threading.Event()
        eng.call(lambda c: gate.wait(30))
        first = eng.submit(prompt, max_new_tokens=2, logit_bias={7: 100.0})  # leaves its row soon
        other = eng.submit(prompt, max_new_tokens=20, ignore_eos=True, logit_bias={9: float("-inf")})
        plain = eng.submit(prompt, max_new_tokens=8)  # waits for a row: takes the first one's
        gate.set()
        assert first.result(30).generated_tokens == [7, 7]
        assert 9 not in other.result(30).generated_tokens
        assert plain.result(30).generated_tokens == ref
