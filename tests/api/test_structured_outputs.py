"""Structured outputs in the engine (issue 29): every constrained output is valid on a random
model (which has no preference of its own), with greedy and seeded sampling, n > 1, async
batching, a KV cache small enough to preempt, offload and prefix caching; free requests in the
same batch still equal ``model.generate``; a spec that cannot compile is refused at submit."""

from __future__ import annotations

import json
import re

import anyio
import pytest

import acb
from acb.models import build_tokenizer, default_model
from tests.conftest import eventually, reference_generate

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["s", "m", "l"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-c]{2}-\d{3}"


def check_schema(text: str) -> None:
    """``text`` is compact JSON that fits SCHEMA (checked by hand: keys in order, types, bounds)."""
    obj = json.loads(text)
    assert list(obj) == ["name", "ok", "size", "tags"], obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["ok"], bool) and obj["size"] in ("s", "m", "l")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 9 for t in obj["tags"])
    assert json.dumps(obj, separators=(",", ":"), ensure_ascii=False) == text  # compact: no free whitespace


SPECS = [
    (acb.StructuredOutputs(json=SCHEMA), check_schema),
    (acb.StructuredOutputs(choice=CHOICES), lambda t: t in CHOICES),
    (acb.StructuredOutputs(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    (acb.StructuredOutputs(grammar='root ::= "(" [0-9] ("+" [0-9])? ")"'), lambda t: re.fullmatch(r"\(\d(\+\d)?\)", t)),
    (acb.StructuredOutputs(json_object=True), None),  # any object (a random model may not close it: length)
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model():
    return default_model()


def _valid(spec_check, out) -> None:
    texts = [s.text for s in out.samples] if out.samples else [out.text]
    reasons = [s.finish_reason for s in out.samples] if out.samples else [out.finish_reason]
    for text, reason in zip(texts, reasons):
        assert reason == acb.FinishReason.STOP, (text, reason)
        result = spec_check(text)
        assert result is None or result, text


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(use_async_batching=True),
        dict(use_async_batching=True, num_blocks=32, page_size=4, max_batch_tokens=32),  # preemption (recompute)
        dict(num_blocks=32, page_size=4, max_batch_tokens=32, cpu_offload_space=0.01),  # preemption (offload)
    ],
    ids=["sync", "async", "async-preempt", "offload"],
)
def test_constrained_outputs_are_valid_beside_free_ones(model, tok, cfg):
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, **cfg})
    prompts = [tok(f"prompt number {i} says").input_ids for i in range(10)]
    free_refs = [reference_generate(model, p, 12) for p in prompts[:4]]
    constrained = [(spec, check) for spec, check in SPECS if check is not None]
    with acb.Engine(model, config, tokenizer=tok) as eng:
        sps = [acb.SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in range(4)]
        for k in range(6):
            spec, _ = constrained[k % len(constrained)]
            # greedy, seeded sampling, and n > 1 samples, each with the grammar
            extra = [dict(), dict(temperature=1.0, seed=k), dict(temperature=0.8, n=2, seed=100 + k)][k % 3]
            sps.append(acb.SamplingParams(max_new_tokens=80, structured_outputs=spec, **extra))
        res = eng.generate_batch(prompts, sps, progress_bar=False)
        assert [res[f"req_{i}"].generated_tokens for i in range(4)] == free_refs
        for k in range(6):
            _valid(constrained[k % len(constrained)][1], res[f"req_{4 + k}"])
        # seeded sampling is reproducible with the grammar too
        again = eng.generate(prompts[5], sps[5])
        assert again.generated_tokens == res["req_5"].generated_tokens
        assert eng.stats.preemptions > 0 or "num_blocks" not in cfg


@pytest.mark.parametrize("async_batching", [False, True])
def test_length_ends_with_a_valid_prefix_and_logprobs(model, tok, async_batching):
    """``max_new_tokens`` running out: ``length`` and a prefix of a valid output. Greedy
    ``processed`` logprobs are after the mask (renormalised over the allowed tokens: never below
    the ``raw`` ones, the model's own)."""
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, use_async_batching=async_batching)
    spec = acb.StructuredOutputs(choice=["abcdefghij", "abcdefghijklmnop"])
    with acb.Engine(model, cfg, tokenizer=tok) as eng:
        out = eng.generate("hi", max_new_tokens=2, structured_outputs=spec)
        assert out.finish_reason == acb.FinishReason.LENGTH
        assert any(c.startswith(out.text) for c in spec.choice) and out.text
        raw = eng.generate("hi", max_new_tokens=30, structured_outputs=spec, logprobs=0, logprobs_mode="raw")
        proc = eng.generate("hi", max_new_tokens=30, structured_outputs=spec, logprobs=0, logprobs_mode="processed")
    assert raw.generated_tokens == proc.generated_tokens and raw.text in spec.choice
    assert all(p >= r - 1e-5 for p, r in zip(proc.logprobs, raw.logprobs))
    assert any(p > r + 1e-3 for p, r in zip(proc.logprobs, raw.logprobs))  # the mask did change something


async def test_async_engine_bad_specs_cancel_and_stream(model, tok):
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, use_async_batching=True)
    async with acb.AsyncEngine(model, cfg, tokenizer=tok) as eng:
        for bad, msg in [
            (dict(regex="(ab"), "parenthesis"),
            (dict(json={"type": "nope"}), "nope"),
            (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
        ]:
            with pytest.raises(ValueError, match=f"structured_outputs: .*{msg}"):
                await eng.submit("x", structured_outputs=bad)
        # streamed deltas add up to the output, which is valid
        h = await eng.submit("stream me", max_new_tokens=80, structured_outputs={"json": SCHEMA})
        text = "".join([d.text async for d in h])
        out = await h.result()
        assert text == out.text
        check_schema(out.text)
        # a constrained request cancelled mid-way leaves nothing behind (the KV check after the test);
        # its grammar cannot end for 300 tokens, so the cancel always lands first ("a+" could end on
        # the second token, before the cancel that follows the first one)
        h = await eng.submit(
            "cancel me", max_new_tokens=10_000, ignore_eos=True, structured_outputs={"regex": "a{300}"}
        )
        async for _ in h:
            break
        assert (await h.result()).status == acb.RequestStatus.CANCELLED
        assert not eng.ids.live


def test_structured_outputs_need_a_tokenizer_and_flexible_whitespace(model, tok):
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32)) as eng:
        with pytest.raises(ValueError, match="need a tokenizer"):
            eng.generate([5, 6], structured_outputs={"json_object": True})
    with pytest.raises(TypeError, match="structured_outputs must be"):
        acb.SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="exactly one of"):
        acb.SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    # whitespace_flexible: the mask allows whitespace between JSON tokens (compact does not)
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32), tokenizer=tok) as eng:
        g = eng.grammars()
        space = tok.convert_tokens_to_ids(" ") if " " in tok.get_vocab() else tok(" ").input_ids[-1]
        for flexible, allowed in ((False, False), (True, True)):
            m = g.compile_now(acb.StructuredOutputs(json=SCHEMA, whitespace_flexible=flexible)).matcher()
            assert m.accept(tok("{").input_ids[-1])
            mask = g.bitmask(1)
            m.fill_mask(mask, 0)
            assert bool((int(mask[0, space // 32]) >> (space % 32)) & 1) is allowed


@pytest.mark.parametrize("async_batching", [False, True])
def test_stop_strings_and_prefix_cache_with_a_grammar(model, tok, async_batching):
    """A stop string inside the constrained output ends it there (the text cut before it, a
    prefix of a valid output); a constrained request reads the prefix cache like any other."""
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, use_async_batching=async_batching)
    spec = acb.StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2}")
    prompt = tok("a shared prefix of some length, then the question").input_ids
    with acb.Engine(model, cfg, tokenizer=tok) as eng:
        free = eng.generate(prompt, max_new_tokens=20, structured_outputs=spec)
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", free.text)
        cut = eng.generate(prompt, max_new_tokens=20, structured_outputs=spec, stop=["-"])
        assert cut.finish_reason == acb.FinishReason.STOP and cut.text == free.text.split("-")[0]
        assert cut.generated_tokens == free.generated_tokens[: len(cut.generated_tokens)]
        assert cut.num_cached_tokens > 0  # the same prompt's full blocks came from the cache


# over a minute of xgrammar's time on the tiny vocabulary, if the repetition limit lets it through
SLOW_SCHEMA = {"type": "string", "pattern": "a{1,30000}"}
HANG_GUARD = 300  # seconds: only so that a regression fails instead of hanging


async def test_grammar_budget_refuses_and_starves_no_one(model, tok):
    """Issue 36: the reported 54-byte schema is refused at submit (the static limit); let through
    by a raised limit, two of them are stopped at the time limit while a small constrained request
    from someone else is answered; and the engine stops while a compile runs."""
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(num_blocks=64), tokenizer=tok) as eng:
        with pytest.raises(ValueError, match=r"structured_outputs: .*grammar_max_repetition"):
            await eng.submit("x", structured_outputs={"json": SLOW_SCHEMA})
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=64, use_async_batching=True, grammar_max_repetition=10**6, grammar_compile_timeout_s=1.0
    )
    async with acb.AsyncEngine(model, cfg, tokenizer=tok) as eng:
        refused: list[str] = []

        async def slow(i: int) -> None:
            spec = {"json": {**SLOW_SCHEMA, "pattern": f"a{{1,{30000 + i}}}"}}
            with pytest.raises(ValueError) as info:
                await eng.submit("x", structured_outputs=spec)
            refused.append(str(info.value))

        compiler = await anyio.to_thread.run_sync(eng.grammars)
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow, 0)
                tg.start_soon(slow, 1)
                # both workers hold a slow compile before the small one is asked for
                await eventually(
                    lambda: len(compiler._cache) == 2 and all(f.running() for f in compiler._cache.values()),
                    "both slow compiles running",
                )
                out = await eng.generate("pick", max_new_tokens=10, structured_outputs={"choice": ["yes", "no"]})
        assert out.text in ("yes", "no") and out.finish_reason == acb.FinishReason.STOP
        assert len(refused) == 2 and all(
            "took longer than 1 s, the limit (ContinuousBatchingConfig.grammar_compile_timeout_s)" in r for r in refused
        ), refused
    # stopping with a compile in flight: the compile's submit ends (engine stopped), the stop returns
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, grammar_max_repetition=10**6, grammar_compile_timeout_s=600)
    eng = acb.AsyncEngine(model, cfg, tokenizer=tok)
    async with eng:
        compiler = await anyio.to_thread.run_sync(eng.grammars)
        future = compiler.submit(acb.StructuredOutputs(json=SLOW_SCHEMA))
        await eventually(future.running, "the compile running")
    with pytest.raises(acb.EngineNotRunningError):
        future.result(HANG_GUARD)


# ---------------------------------------------------------------------------------------------
# constraints that cannot be met (issue 36: they failed as "token 0 does not continue the output's
# grammar", an internal error)


def tokenizer_without(chars: str):
    """The embedded byte-level tokenizer, less the tokens of ``chars`` (their bytes have no token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        if ch not in chars:
            vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


SELF_REQUIRED = {
    "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
    "$ref": "#/$defs/a",
}


@pytest.mark.parametrize(
    "spec, extra, message",
    [
        ({"json": {"$ref": "#"}}, {}, "the json constraint can never be met: it matches no text at all"),
        ({"json": SELF_REQUIRED}, {}, "the json constraint can never be met: it matches no text at all"),
        ({"grammar": 'root ::= "a" root'}, {}, "the grammar constraint can never be met: it matches no text"),
        (
            {"grammar": 'root ::= "(" root ")" | "x" loop\nloop ::= "y" loop'},
            {},
            "the grammar constraint can never be met",
        ),
        (
            {"choice": ["yes", "no"]},
            {"min_new_tokens": 4},
            r"min_new_tokens=4 \(min_tokens\) can never be met: every output of the choice constraint has at most 3 "
            "tokens before its end",
        ),
        ({"grammar": 'root ::= ""'}, {"min_new_tokens": 1}, "min_new_tokens=1 .* at most 0 tokens"),
    ],
)
async def test_unsatisfiable_constraints_are_refused_at_submit(model, tok, spec, extra, message):
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(num_blocks=32), tokenizer=tok) as eng:
        with pytest.raises(ValueError, match=f"structured_outputs: {message}"):
            await eng.submit("x", structured_outputs=spec, max_new_tokens=8, **extra)
        with pytest.raises(ValueError, match=f"structured_outputs: {message}"):
            eng.submit_nowait("x", structured_outputs=spec, max_new_tokens=8, **extra)
        # min_new_tokens the output can meet, or a stop token min_new_tokens does not hold back: accepted
        out = await eng.generate("x", structured_outputs={"choice": ["yes", "no"]}, max_new_tokens=8, min_new_tokens=2)
        assert out.text in ("yes", "no")


def test_a_vocabulary_without_the_first_character_is_refused_at_submit(model):
    tok = tokenizer_without("{")
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32), tokenizer=tok) as eng:
        with pytest.raises(
            ValueError,
            match=r"structured_outputs: the json constraint can never be met: the "
            r"tokenizer's vocabulary has no token that starts it .*'\{'",
        ):
            eng.generate([5, 6, 7], structured_outputs={"json": SCHEMA})
        with pytest.raises(ValueError, match="vocabulary has no token"):
            eng.generate([5, 6, 7], structured_outputs={"json_object": True})
        assert eng.generate([5, 6, 7], structured_outputs={"choice": ["ab"]}, max_new_tokens=5).text == "ab"


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"use_async_batching": True},
        {"use_async_batching": True, "num_blocks": 12, "page_size": 4, "max_batch_tokens": 16},  # preemption
    ],
    ids=["sync", "async", "async-preempt"],
)
def test_a_grammar_that_cannot_go_on_ends_with_finish_reason_grammar(model, tok, cfg):
    """Found only while generating: the request ends, FINISHED with ``FinishReason.GRAMMAR``, its
    output the tokens before the dead end (a prefix of a match); the others are unaffected."""
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, **cfg})
    b = tok("b").input_ids[-1]
    prompts = [tok(f"prompt {i}").input_ids for i in range(7)]
    refs = [reference_generate(model, p, 10) for p in prompts[:3]]
    with acb.Engine(model, config, tokenizer=tok) as eng:
        sps = [acb.SamplingParams(max_new_tokens=10) for _ in range(3)] + [
            # "ab" is complete after 2 tokens; min_new_tokens holds back the end it must take then
            acb.SamplingParams(max_new_tokens=10, min_new_tokens=4, structured_outputs={"regex": "ab"}),
            # the only way on is a token whose bias is -inf
            acb.SamplingParams(max_new_tokens=10, logit_bias={b: float("-inf")}, structured_outputs={"choice": ["ab"]}),
            acb.SamplingParams(
                max_new_tokens=10,
                min_new_tokens=5,
                n=2,
                temperature=1.0,
                seed=3,
                structured_outputs={"regex": "(ab|ba)c"},
            ),
            # both bans at once: after "a", min_new_tokens holds back the end and "b" is -inf
            acb.SamplingParams(
                max_new_tokens=10, min_new_tokens=3, logit_bias={b: float("-inf")}, structured_outputs={"regex": "ab?"}
            ),
        ]
        res = eng.generate_batch(prompts, sps, progress_bar=False)
        assert [res[f"req_{i}"].generated_tokens for i in range(3)] == refs
        grammar_end = (acb.RequestStatus.FINISHED, acb.FinishReason.GRAMMAR)
        out = res["req_3"]
        assert (out.status, out.finish_reason, out.text, out.error) == (*grammar_end, "ab", None)
        assert out.generated_tokens == tok("ab").input_ids[-2:]
        out = res["req_4"]
        assert (out.status, out.finish_reason, out.text) == (*grammar_end, "a")
        for s in res["req_5"].samples:
            assert (s.finish_reason, s.text in ("abc", "bac")) == (acb.FinishReason.GRAMMAR, True), s
        out = res["req_6"]
        assert (out.status, out.finish_reason, out.text) == (*grammar_end, "a")
        # alone, streamed: the deltas add up to the output, which ends the same way
        assert eng.generate(prompts[0], sps[3]).text == "ab"
        assert not eng.ids.live
        assert eng.stats.preemptions > 0 or "max_batch_tokens" not in cfg


async def test_a_vocabulary_gap_midway_ends_with_finish_reason_grammar(model):
    """The first token exists but the second character of the only match has no token."""
    tok = tokenizer_without("b")
    cfg = acb.ContinuousBatchingConfig(num_blocks=12, page_size=4, use_async_batching=True)
    async with acb.AsyncEngine(model, cfg, tokenizer=tok) as eng:
        h = await eng.submit([5, 6, 7], max_new_tokens=10, structured_outputs={"regex": "ab"})
        tokens = [t async for d in h for t in d.token_ids]
        out = await h.result()
        assert (out.status, out.finish_reason, out.text) == (acb.RequestStatus.FINISHED, acb.FinishReason.GRAMMAR, "a")
        assert tokens == out.generated_tokens == tok("a").input_ids[-1:]


async def test_a_spec_that_cannot_compile_names_its_field_on_both_submits(model, tok):
    """AsyncEngine.submit (which compiles off the event loop first) and submit_nowait refuse a spec
    that cannot compile the same way: an InvalidRequestError whose field is structured_outputs
    (submit once re-raised it as a plain ValueError, losing the field)."""
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(num_blocks=32), tokenizer=tok) as eng:
        for call in (eng.submit, eng.submit_nowait):
            with pytest.raises(acb.InvalidRequestError, match="^structured_outputs: cannot compile") as info:
                res = call("x", structured_outputs={"regex": "(ab"})
                if hasattr(res, "__await__"):
                    await res
            assert info.value.field == "structured_outputs"
