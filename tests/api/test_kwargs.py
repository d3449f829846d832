"""Sampling keyword arguments behave the same at every entry point, and errors name the method."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import acb
from acb.sampling_params import SamplingKwargs
from tests.conftest import get_model, prompts_of_lengths, reference_generate

CFG = dict(num_blocks=64)
PROMPT = [5, 6, 7, 8]


def test_sampling_kwargs_name_every_field():
    assert set(typing.get_type_hints(SamplingKwargs)) == {f.name for f in dataclasses.fields(acb.SamplingParams)}


def test_blocking_engine_kwargs_equal_sampling_params():
    model = get_model("llama")
    ref = reference_generate(model, PROMPT, 6)
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        greedy = eng.generate(PROMPT, max_new_tokens=6)
        assert greedy.generated_tokens == ref
        by_kwargs = eng.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=3)
        by_params = eng.generate(PROMPT, acb.SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
        assert by_kwargs.generated_tokens == by_params.generated_tokens
        # keywords override the fields of ``sampling``; the rest of it still applies
        mixed = eng.submit(
            PROMPT, acb.SamplingParams(max_new_tokens=20, temperature=0.7, seed=3), max_new_tokens=8
        ).result()
        assert mixed.generated_tokens == by_params.generated_tokens
        h = eng.submit_nowait(PROMPT, max_new_tokens=2, ignore_eos=True)
        assert len(h.result().generated_tokens) == 2


async def test_async_engine_kwargs_equal_sampling_params():
    model = get_model("llama")
    ref = reference_generate(model, PROMPT, 6)
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        greedy = await eng.generate(PROMPT, max_new_tokens=6)
        assert greedy.generated_tokens == ref
        by_kwargs = await eng.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=3, request_id="x")
        by_params = await eng.generate(PROMPT, acb.SamplingParams(max_new_tokens=8, temperature=0.7, seed=3))
        assert by_kwargs.request_id == "x"
        assert by_kwargs.generated_tokens == by_params.generated_tokens
        h = await eng.submit(PROMPT, max_new_tokens=3, ignore_eos=True)
        assert len((await h.result()).generated_tokens) == 3
        h = eng.submit_nowait(PROMPT, max_new_tokens=2, ignore_eos=True)
        assert len((await h.result()).generated_tokens) == 2


def test_generate_batch_kwargs():
    model = get_model("llama")
    prompts = prompts_of_lengths([3, 7], seed=4)
    cb = acb.ContinuousBatchingConfig(**CFG)
    by_kwargs = acb.generate_batch(
        model,
        prompts,
        continuous_batching_config=cb,
        progress_bar=False,
        max_new_tokens=5,
        temperature=0.9,
        seed=11,
        warmup=False,
    )
    by_params = acb.generate_batch(
        model,
        prompts,
        continuous_batching_config=cb,
        progress_bar=False,
        sampling=acb.SamplingParams(max_new_tokens=5, temperature=0.9, seed=11),
    )
    assert [o.generated_tokens for o in by_kwargs.values()] == [o.generated_tokens for o in by_params.values()]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(max_tokens=5), TypeError, ["'max_tokens' is called 'max_new_tokens'"]),
        (dict(temprature=0.5), TypeError, ["'temprature'", "acb.SamplingParams"]),
        (dict(temperature=-1.0), ValueError, ["temperature"]),
        (dict(top_k="3"), TypeError, ["top_k"]),
    ],
)
async def test_bad_kwargs_name_the_method(kwargs, error, words):
    model = get_model("llama")
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        for method, call in (("generate", eng.generate), ("submit", eng.submit), ("submit_nowait", eng.submit_nowait)):
            with pytest.raises(error) as info:
                call(PROMPT, **kwargs)
            assert str(info.value).startswith(f"{method}()") and all(w in str(info.value) for w in words)
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(**CFG)) as aeng:
        for method in ("generate", "submit"):
            with pytest.raises(error) as info:
                await getattr(aeng, method)(PROMPT, **kwargs)
            assert str(info.value).startswith(f"{method}()")
        with pytest.raises(error, match=r"^submit_nowait\(\)"):
            aeng.submit_nowait(PROMPT, **kwargs)
    with pytest.raises(error, match=r"^generate_batch\(\)"):
        acb.generate_batch(model, [PROMPT], progress_bar=False, **kwargs)
