"""Token ids, text and chats are the same prompt at every entry point that takes prompts."""

from __future__ import annotations

import pytest

import acb
from acb.models import build_tokenizer, tiny_model
from tests.conftest import reference_generate
from tests.test_text import byte_tokenizer

CHAT = [{"role": "user", "content": "héllo 😀"}]
TEXT = "wörld, ça va?"
MAX = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=len(byte_tokenizer()))


def _ids(tok, prompt):
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check(tok, outs, refs):
    for out, ref in zip(outs, refs):
        assert out.generated_tokens == ref
        assert out.text == tok.decode(ref, skip_special_tokens=True, clean_up_tokenization_spaces=False)


MODES = {
    "plain": dict(num_blocks=64),
    # the CUDA default, on the CPU runner's twin of it
    "async": dict(num_blocks=64, use_async_batching=True),
    # a cache so small that requests preempt each other, offloading their KV to host memory
    "preempt-offload": dict(page_size=8, num_blocks=8, use_async_batching=True, cpu_offload_space=0.01),
}


@pytest.fixture(params=list(MODES))
def mode(request):
    return request.param


def _cfg(mode="plain"):
    return acb.ContinuousBatchingConfig(**MODES[mode])


@pytest.fixture(scope="module")
def refs(model):
    tok = byte_tokenizer()
    ids = {"text": _ids(tok, TEXT), "chat": _ids(tok, CHAT)}
    return ids, {k: reference_generate(model, v, MAX) for k, v in ids.items()}


def test_blocking_entry_points(model, refs, mode):
    tok = byte_tokenizer()
    ids, ref = refs
    prompts = [TEXT, CHAT, ids["text"], ids["chat"]]
    want = [ref["text"], ref["chat"], ref["text"], ref["chat"]]
    with acb.Engine(model, _cfg(mode), tokenizer=tok) as eng:
        _check(tok, [eng.generate(p, max_new_tokens=MAX) for p in prompts], want)
        streamed = []
        for p in prompts:
            h = eng.submit_nowait(p, max_new_tokens=MAX)
            text = "".join(d.text or "" for d in h)
            out = h.result()
            assert text == out.text
            streamed.append(out)
        _check(tok, streamed, want)
    outs = acb.generate_batch(
        model, prompts, continuous_batching_config=_cfg(mode), tokenizer=tok, max_new_tokens=MAX, progress_bar=False
    )
    assert list(outs) == ["req_0", "req_1", "req_2", "req_3"]
    _check(tok, list(outs.values()), want)
    assert [o.prompt_ids for o in outs.values()] == [ids["text"], ids["chat"], ids["text"], ids["chat"]]


async def test_async_entry_points(model, refs, mode):
    tok = byte_tokenizer()
    ids, ref = refs
    prompts = [TEXT, CHAT, ids["text"]]
    want = [ref["text"], ref["chat"], ref["text"]]
    async with acb.AsyncEngine(model, _cfg(mode), tokenizer=tok) as eng:
        _check(tok, [await eng.generate(p, max_new_tokens=MAX) for p in prompts], want)
        outs = []
        for i, p in enumerate(prompts):
            h = eng.submit_nowait(p, max_new_tokens=MAX) if i % 2 else await eng.submit(p, max_new_tokens=MAX)
            text = "".join([d.text or "" async for d in h])
            outs.append(await h.result())
            assert text == outs[-1].text
        _check(tok, outs, want)


def test_chat_template_kwargs_reach_the_template(model):
    tok = build_tokenizer()
    tok.chat_template = (
        "{% if persona %}[{{ persona }}]{% endif %}{% for m in messages %}{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with acb.Engine(model, _cfg(), tokenizer=tok) as eng:
        plain = eng.generate(CHAT, max_new_tokens=1)
        styled = eng.generate(CHAT, max_new_tokens=1, chat_template_kwargs={"persona": "pirate"})
    assert plain.prompt_ids == tok("héllo 😀>", add_special_tokens=False)["input_ids"]
    assert styled.prompt_ids == tok("[pirate]héllo 😀>", add_special_tokens=False)["input_ids"]


async def test_streamed_text_never_shows_a_stop_string(model, mode):
    """The deltas' texts add up to output.text, which ends before the stop string, even when the
    stop string arrives inside one token or spread over several (n > 1 too)."""
    tok = byte_tokenizer()
    async with acb.AsyncEngine(model, _cfg(mode), tokenizer=tok) as eng:
        full = (await eng.generate(TEXT, max_new_tokens=16, ignore_eos=True)).text
        assert full and len(full) > 4
        stops = (full[3], full[2:4], full[3:5] + "never")  # one char, two chars, never complete
        # all at once: in the small-cache mode they preempt each other
        handles = [await eng.submit(TEXT, max_new_tokens=16, stop=stop, n=2, seed=0) for stop in stops]

        async def read(h):
            streamed: dict[int, str] = {}
            async for d in h:
                streamed[d.sample_index] = streamed.get(d.sample_index, "") + (d.text or "")
            return streamed, await h.result()

        results = [await read(h) for h in handles]
        preemptions, offloaded = eng.stats.preemptions, eng.stats.swapped_out_blocks
    for stop, (streamed, out) in zip(stops, results):
        for s in out.samples:
            assert streamed.get(s.index, "") == s.text
            assert stop not in s.text
            assert full.startswith(s.text)  # greedy: the same text, ended by the stop string or EOS
    assert (preemptions > 0) == (offloaded > 0) == (mode == "preempt-offload")
