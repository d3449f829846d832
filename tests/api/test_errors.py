"""Bad input is rejected at submit with a clear message; failures never hang a handle."""

from __future__ import annotations

import asyncio

import pytest
import torch

import acb
from tests.conftest import eventually, get_model, reference_generate

CFG = acb.ContinuousBatchingConfig(page_size=8, num_blocks=16)  # 120 tokens per request at most


@pytest.fixture
def model():
    return get_model("llama")


async def test_bad_inputs_rejected_others_unaffected(model):
    async with acb.AsyncEngine(model, CFG) as eng:
        good = await eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=8))
        cases = [
            (([],), {}, ValueError, "empty"),
            (([5, 256],), {}, ValueError, r"prompt_ids\[1\] = 256 is outside the model's vocabulary \[0, 256\)"),
            (([5, -1],), {}, ValueError, "outside the model's vocabulary"),
            ((list(range(3, 200)),), {}, ValueError, "can never fit"),
            (("hello",), {}, TypeError, "the prompt is text, but the engine has no tokenizer"),
            (([1.5, 2],), {}, TypeError, "must hold ints"),
            (([1, 2],), {"request_id": good.request_id}, ValueError, "already used by a live request"),
            (([1, 2], "greedy"), {}, TypeError, "SamplingParams"),
        ]
        for args, kw, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                await eng.submit(*args, **kw)
        for bad, field in (
            (dict(max_new_tokens=0), "max_new_tokens"),
            (dict(max_new_tokens=-3), "max_new_tokens"),
            (dict(temperature=-1.0), "temperature"),
            (dict(temperature=float("nan")), "temperature"),
            (dict(logprobs=21), "logprobs"),
            (dict(top_p=0.0), "top_p"),
            (dict(top_k=-1), "top_k"),
            (dict(min_p=1.5), "min_p"),
            (dict(repetition_penalty=0.0), "repetition_penalty"),
            (dict(presence_penalty=3.0), "presence_penalty"),
            (dict(logprobs_mode="x"), "logprobs_mode"),
            (dict(stop=[""]), "stop"),
            (dict(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
            (dict(n=0), "n"),
            (dict(logit_bias={-1: 1.0}), "logit_bias"),
            (dict(seed=1.5), "seed"),
            (dict(do_sample="yes"), "do_sample"),
        ):
            with pytest.raises((ValueError, TypeError), match=field):
                acb.SamplingParams(**bad)
        with pytest.raises(ValueError, match="logit_bias token id 300"):
            await eng.submit([1, 2], acb.SamplingParams(logit_bias={300: 1.0}))
        with pytest.raises(ValueError, match="tokenizer"):
            await eng.submit([1, 2], acb.SamplingParams(stop=["x"]))
        out = await good.result()
    assert out.status == acb.RequestStatus.FINISHED
    assert out.generated_tokens == reference_generate(model, [5, 6, 7], 8)


async def test_max_new_tokens_clamped_to_capacity(model):
    async with acb.AsyncEngine(model, CFG) as eng:
        assert eng.config.max_model_len == 120
        out = await eng.generate(list(range(3, 103)), acb.SamplingParams(max_new_tokens=500, ignore_eos=True))
    assert out.finish_reason == acb.FinishReason.LENGTH and len(out.generated_tokens) == 20


def test_failure_in_a_step_fails_only_its_requests(model, monkeypatch):
    ref = reference_generate(model, [5, 6, 7], 5)  # before the engine swaps the attention in
    with acb.Engine(model, CFG) as eng:
        runner = eng.core.runner
        real = runner.execute
        calls = {"n": 0}

        def flaky(sched):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure")
            return real(sched)

        monkeypatch.setattr(runner, "execute", flaky)
        h1 = eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=5))
        with pytest.raises(acb.RequestFailedError, match="injected failure") as ei:
            h1.result(timeout=30)
        assert ei.value.output.status == acb.RequestStatus.FAILED
        # the engine survives and serves the next request
        out = eng.generate([5, 6, 7], acb.SamplingParams(max_new_tokens=5))
        assert out.generated_tokens == ref
        assert eng.stats.failed == 1


async def test_engine_death_fails_every_pending_handle(model, monkeypatch):
    eng = acb.AsyncEngine(model, CFG)
    eng.start()
    sched = eng.core.scheduler
    hs = [await eng.submit([5, 6, i + 3], acb.SamplingParams(max_new_tokens=10_000, ignore_eos=True)) for i in range(3)]
    await eventually(lambda: eng.stats.running == 3, "the three requests run")

    def broken(*a, **k):
        raise AssertionError("scheduler bug")

    monkeypatch.setattr(sched, "schedule", broken)
    for h in hs:
        with pytest.raises(acb.EngineDeadError):
            await asyncio.wait_for(h.result(), 30)

    async def stream(h):
        async for _ in h:
            pass

    with pytest.raises(acb.EngineDeadError):
        await asyncio.wait_for(stream(hs[0]), 30)
    with pytest.raises(acb.EngineDeadError):
        await eng.submit([1, 2, 3])
    # a dead engine gives back every block, row and id (the leak check after the test sees it)
    assert eng.core.pool.num_used == 0 and not eng.ids.live and not sched.live


def test_unsupported_model_refused():
    model = get_model("llama")

    class Fake(torch.nn.Module):
        config = model.config
        _supports_attention_backend = False

        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(2, 2)

    with pytest.raises(acb.UnsupportedModelError, match="AttentionInterface"):
        acb.Engine(Fake()).start()
    cfg = model.config.__class__(**{**model.config.to_dict(), "layer_types": ["linear_attention"] * 2})
    fake = Fake()
    fake.config = cfg
    fake._supports_attention_backend = True
    with pytest.raises(acb.UnsupportedModelError, match="linear_attention"):
        acb.Engine(fake).start()


def test_model_attention_restored_after_engine(model):
    before = model.config._attn_implementation
    with acb.Engine(model, CFG) as eng:
        assert model.config._attn_implementation == "acb_paged"
        eng.generate([5, 6], acb.SamplingParams(max_new_tokens=2))
    assert model.config._attn_implementation == before


# Values that pass a type check but overflow what the engine computes with (issue 26 item 1): each
# is refused when the SamplingParams is built, naming the field.
HUGE = [
    (dict(top_k=10**400), "top_k"),
    (dict(max_new_tokens=10**30), "max_new_tokens"),
    (dict(n=2**63), "n"),
    (dict(min_new_tokens=2**64), "min_new_tokens"),
    (dict(logprobs=10**30), "logprobs"),
    (dict(prompt_logprobs=2**63), "prompt_logprobs"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(temperature=10**400), "temperature"),
    (dict(temperature=1e300), "temperature"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    (dict(logit_bias={5: 1e39}), "logit_bias"),
    (dict(logit_bias={5: 10**400}), "logit_bias"),
    (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={2**64: 1.0}), "logit_bias"),
    (dict(stop_token_ids=(2**63,)), "stop_token_ids"),
    (dict(top_p=10**400), "top_p"),
    (dict(presence_penalty=-(10**400)), "presence_penalty"),
]


@pytest.mark.parametrize("async_batching", [False, True])
async def test_numeric_extremes_are_refused_or_harmless(model, async_batching):
    """Every int fits int64 and every float stays finite through the sampler: out-of-range values
    are refused at construction (with a short message), and the extreme values that are allowed
    (the largest ints, a temperature of 1e-40, biases of +-100 and -inf) run without touching the
    other requests of the step, which stay exact."""
    for bad, field in HUGE:
        with pytest.raises(ValueError, match=field) as ei:
            acb.SamplingParams(**bad)
        assert len(str(ei.value)) < 200  # a 400-digit int is not echoed whole
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    refs = [reference_generate(model, p, 6) for p in prompts]
    top = 2**63 - 1
    allowed = [
        acb.SamplingParams(max_new_tokens=top, top_k=top, seed=top, do_sample=True, temperature=1.0, ignore_eos=True),
        acb.SamplingParams(max_new_tokens=6, seed=-(2**63), temperature=1e4, top_k=top),
        acb.SamplingParams(
            max_new_tokens=6, min_new_tokens=6, stop_token_ids=(5,), seed=1, temperature=0.5, repetition_penalty=100.0
        ),
        acb.SamplingParams(
            max_new_tokens=6,
            seed=2,
            temperature=0.5,
            repetition_penalty=0.01,
            logit_bias={3: 100.0, 4: -100.0, 7: float("-inf")},
        ),
        acb.SamplingParams(max_new_tokens=6, seed=3, temperature=1e-40),
    ]
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, use_async_batching=async_batching)
    async with acb.AsyncEngine(model, cfg) as eng:
        held = eng.core.call(lambda c: __import__("time").sleep(0.2))  # the whole burst lands in one step
        handles = [await eng.submit(p, acb.SamplingParams(max_new_tokens=6)) for p in prompts]
        odd = [await eng.submit([5, 6, 7], sp) for sp in allowed]
        held.result()
        outs = [await h.result() for h in handles]
        odd_outs = [await h.result() for h in odd]
        # a temperature below 0.01 samples at 0.01: the same draws as asking for 0.01
        clamped = await eng.generate([5, 6, 7], acb.SamplingParams(max_new_tokens=6, seed=3, temperature=0.01))
    assert [o.generated_tokens for o in outs] == refs
    assert all(o.status == acb.RequestStatus.FINISHED for o in odd_outs)
    assert odd_outs[0].finish_reason == acb.FinishReason.LENGTH  # max_new_tokens clamped to the capacity
    assert len(odd_outs[0].generated_tokens) == eng.config.max_model_len - 3
    assert 7 not in odd_outs[3].generated_tokens
    assert odd_outs[4].generated_tokens == clamped.generated_tokens
    assert odd_outs[4].generated_tokens != [255] * 6  # not the last vocabulary id every step (inf logits)


def test_refusals_carry_their_field(model):
    """Every refusal at submit names the argument it is about in ``field`` (what a server maps to
    its ``param``), stays a ValueError/TypeError, and keeps its field through a batch's prefix
    (``inputs[i]: ...``) and a pickle."""
    import pickle

    def field_of(call) -> str:
        with pytest.raises((ValueError, TypeError)) as e:
            call()
        assert isinstance(e.value, (acb.InvalidRequestError, acb.InvalidRequestTypeError)), repr(e.value)
        assert isinstance(e.value, ValueError if isinstance(e.value, acb.InvalidRequestError) else TypeError)
        return e.value.field

    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16, max_requests_per_batch=4)) as eng:
        live = eng.submit([5, 6, 7], acb.SamplingParams(max_new_tokens=50, ignore_eos=True))
        cases = [
            (lambda: eng.submit([]), "prompt"),
            (lambda: eng.submit([5, 256]), "prompt"),
            (lambda: eng.submit(list(range(3, 200))), "prompt"),
            (lambda: eng.submit("hello"), "prompt"),  # text without a tokenizer (acb.text's refusal)
            (lambda: eng.submit([1.5, 2]), "prompt"),
            (lambda: eng.submit([1, 2], "greedy"), "sampling"),
            (lambda: eng.submit([1, 2], request_id=live.request_id), "request_id"),
            (lambda: eng.submit([1, 2], request_id=7), "request_id"),
            (lambda: eng.submit([1, 2], cache_salt=3), "cache_salt"),
            (lambda: eng.submit([1, 2], logit_bias={300: 1.0}), "logit_bias"),
            (lambda: eng.submit([1, 2], stop_token_ids=[300]), "stop_token_ids"),
            (lambda: eng.submit([1, 2], stop=["x"]), "stop"),  # no tokenizer
            (lambda: eng.submit([1, 2], n=5), "n"),  # more samples than rows
            (lambda: eng.submit([1, 2], max_new_tokens=0), "max_new_tokens"),  # SamplingParams
            (lambda: eng.submit([1, 2], structured_outputs={"regex": ""}), "structured_outputs"),
            (lambda: eng.score([1, 2], [[300]]), "continuations"),
            (lambda: eng.score([1, 2], []), "continuations"),
            (lambda: eng.score([], [[3]]), "context"),
            (lambda: eng.score([1, 2], [[3]], top_logprobs=-1), "top_logprobs"),
            (lambda: eng.score_batch([([1, 2], [[3]])], request_ids=["a", "b"]), "request_ids"),
        ]
        for call, field in cases:
            assert field_of(call) == field
        with pytest.raises(ValueError, match=r"^inputs\[1\]: prompt_ids\[0\] = 999") as e:
            eng.generate_batch([[1, 2], [999]], progress_bar=False)
        assert e.value.field == "prompt"
        with pytest.raises(ValueError, match=r"^items\[0\]: ") as e:
            eng.score_batch([([1, 2], [[3], []])], progress_bar=False)
        assert e.value.field == "continuations"
        live.cancel()
    again = pickle.loads(pickle.dumps(acb.InvalidRequestError("n=9 ...", "n")))
    assert (type(again), str(again), again.field) == (acb.InvalidRequestError, "n=9 ...", "n")


def test_samples_cancelled_before_they_fork_say_cancelled(model):
    """An ``n > 1`` request cancelled before its prompt was computed (its samples not forked yet):
    every sample ends CANCELLED with finish reason ``cancelled`` (the unforked ones once had none)."""
    import threading

    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=32)) as eng:
        gate = threading.Event()
        eng.call(lambda c: gate.wait(30))  # the engine holds: the request is never scheduled
        h = eng.submit([5, 6, 7, 8], acb.SamplingParams(n=3, max_new_tokens=4))
        eng.cancel(h.request_id)
        gate.set()
        out = h.result(timeout=60)
    assert out.status == acb.RequestStatus.CANCELLED and len(out.samples) == 3
    assert [(s.status, s.finish_reason) for s in out.samples] == [
        (acb.RequestStatus.CANCELLED, acb.FinishReason.CANCELLED)
    ] * 3
