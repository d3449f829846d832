"""Double-buffered async batching on CPU: step N+1 is scheduled and launched before step N's
tokens are read, its decode inputs filled on the device from N's samples. Same bookkeeping as
on CUDA, without the overlap, so its correctness is tested here."""

from __future__ import annotations

import threading

import pytest

import acb
from tests.conftest import get_model, prompts_of_lengths, reference_generate

LENGTHS = [1, 7, 8, 9, 23, 40, 64]


def cfg(**kw) -> acb.ContinuousBatchingConfig:
    return acb.ContinuousBatchingConfig(**{"page_size": 8, "num_blocks": 256, "use_async_batching": True, **kw})


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("llama", {}),
        ("qwen2", {"max_batch_tokens": 12}),  # chunked prefill mixed with decodes
        ("mistral", {"scheduler_type": "prefill_first", "max_batch_tokens": 16}),
    ],
)
def test_async_parity(arch, extra):
    model = get_model(arch)
    prompts = prompts_of_lengths(LENGTHS, seed=70)
    refs = [reference_generate(model, p, 12) for p in prompts]
    with acb.Engine(model, cfg(**extra)) as eng:
        assert eng.config.async_batching
        outs = [h.result(timeout=120) for h in [eng.submit(p, acb.SamplingParams(max_new_tokens=12)) for p in prompts]]
    assert [o.generated_tokens for o in outs] == refs


def test_async_preemption_offload_prefix_cache_and_groups():
    model = get_model("llama")
    base = prompts_of_lengths([30], seed=71)[0]
    prompts = [base[:20], base, base[:9] + [5, 6], base[:28]] + prompts_of_lengths([17, 25, 12], seed=72)
    refs = [reference_generate(model, p, 14) for p in prompts]
    for offload in (0.0, 0.01):
        c = cfg(page_size=4, num_blocks=24, safety_margin=0.0, cpu_offload_space=offload)
        with acb.Engine(model, c) as eng:
            hs = [
                eng.submit(p, acb.SamplingParams(max_new_tokens=14, n=2 if i == 1 else 1))
                for i, p in enumerate(prompts)
            ]
            outs = [h.result(timeout=120) for h in hs]
            assert eng.stats.preemptions > 0
        assert [o.generated_tokens for o in outs] == refs
        assert [s.generated_tokens for s in outs[1].samples] == [refs[1]] * 2


def test_async_stop_tokens_seeds_and_logprobs_match_sync():
    model = get_model("llama")
    prompts = prompts_of_lengths([5, 12, 30], seed=73)
    stop = reference_generate(model, prompts[1], 20)[4]  # one request stops early: its next slot is wasted
    sps = [
        acb.SamplingParams(max_new_tokens=20, temperature=0.9, top_k=20, seed=11, logprobs=1),
        acb.SamplingParams(max_new_tokens=20, stop_token_ids=(stop,), logprobs=0),
        acb.SamplingParams(max_new_tokens=20, repetition_penalty=1.3, min_new_tokens=3),
    ]
    results = {}
    for mode in (False, True):
        with acb.Engine(model, cfg(use_async_batching=mode)) as eng:
            results[mode] = [h.result(timeout=60) for h in [eng.submit(p, sp) for p, sp in zip(prompts, sps)]]
    for a, b in zip(results[False], results[True]):
        assert a.generated_tokens == b.generated_tokens and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert results[True][1].finish_reason == acb.FinishReason.STOP


def test_cancel_during_in_flight_step(monkeypatch):
    model = get_model("llama")
    prompts = prompts_of_lengths([6, 11, 19], seed=74)
    refs = [reference_generate(model, p, 16) for p in prompts]
    with acb.Engine(model, cfg()) as eng:
        core = eng.core
        real = core.runner.execute
        seen = {"n": 0}

        def execute(sched):
            handle = real(sched)
            seen["n"] += 1
            if seen["n"] == 5:  # cancel request 0 while this step is launched, before it is read
                core.cancel(hs[0].request_id)
            return handle

        monkeypatch.setattr(core.runner, "execute", execute)
        gate = threading.Event()
        core.call(lambda c: gate.wait())  # hold the engine until every request is submitted
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=16)) for p in prompts]
        gate.set()
        outs = [h.result(timeout=60) for h in hs]
    assert len(refs[0]) == 16  # (request 0 runs to its length limit unless cancelled)
    assert outs[0].status == acb.RequestStatus.CANCELLED and 3 <= len(outs[0].generated_tokens) < 16
    assert outs[0].generated_tokens == refs[0][: len(outs[0].generated_tokens)]
    assert [outs[1].generated_tokens, outs[2].generated_tokens] == [refs[1], refs[2]]


def test_async_shared_prefix_is_computed_once():
    # with the previous step still in flight, same-prefix requests wait for its blocks to be recorded
    model = get_model("llama")
    prefix = prompts_of_lengths([40], seed=75)[0]
    prompts = [prefix + [3 + i] for i in range(6)]
    refs = [reference_generate(model, p, 6) for p in prompts]
    with acb.Engine(model, cfg(max_batch_tokens=48)) as eng:
        gate = threading.Event()
        eng.call(lambda c: gate.wait())
        hs = [eng.submit(p, acb.SamplingParams(max_new_tokens=6)) for p in prompts]
        gate.set()
        outs = [h.result(timeout=60) for h in hs]
        prefilled = eng.stats.prefill_tokens
    assert [o.generated_tokens for o in outs] == refs
    assert prefilled == 41 + 5 * (41 - 40)  # 40 = 5 full blocks of 8, computed once
