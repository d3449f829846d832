"""Scoring requests (``Engine.score`` / ``score_batch``, ``AsyncEngine.score``): each continuation
token's logprob equals a full forward's log-softmax over context + continuation (1e-5), greedy
flags and top-k too, whatever the batch: several continuations of one context, contexts longer
than a prefill chunk, cached prefixes (the count of cached tokens proves the cache was read),
async batching, preemption under a tiny cache with and without offload. The LM head runs on the
scored rows alone (counted), at most ``max_scored_rows`` at a time."""

from __future__ import annotations

import threading

import pytest
import torch

import acb
from tests.conftest import HANG_GUARD, eventually, get_model, prompts_of_lengths

CFG = dict(page_size=8, num_blocks=64)


@pytest.fixture(scope="module")
def model():
    return get_model("llama")


def reference(model, ctx: list[int], cont: list[int], k: int = 2):
    """(logprobs, greedy, top-k) of ``cont`` after ``ctx`` from one plain forward."""
    with torch.no_grad():
        lp = model(torch.tensor([ctx + cont])).logits[0].double().log_softmax(-1)
    rows = lp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
    values = rows[torch.arange(len(cont)), torch.tensor(cont)].tolist()
    greedy = rows.argmax(-1).tolist() == cont
    top = rows.topk(k, dim=-1)
    return values, greedy, [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]


def check(model, out: acb.ScoreOutput, ctx: list[int], conts: list[list[int]], k: int = 0) -> None:
    assert out.status == acb.RequestStatus.FINISHED and out.context_ids == ctx
    assert [s.token_ids for s in out.continuations] == conts
    for s, cont in zip(out.continuations, conts):
        values, greedy, top = reference(model, ctx, cont, max(k, 1))
        torch.testing.assert_close(
            torch.tensor(s.logprobs, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), atol=1e-5, rtol=0
        )
        assert s.logprob == pytest.approx(sum(values), abs=1e-4)
        assert s.greedy == greedy
        if k:
            assert [[i for i, _ in t] for t in s.top_logprobs] == [[i for i, _ in t] for t in top]
            torch.testing.assert_close(
                torch.tensor([[v for _, v in t] for t in s.top_logprobs], dtype=torch.float64),
                torch.tensor([[v for _, v in t] for t in top], dtype=torch.float64),
                atol=1e-5,
                rtol=0,
            )
        else:
            assert s.top_logprobs is None


def greedy_after(model, ctx: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ctx]),
            attention_mask=torch.ones(1, len(ctx), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ctx) :].tolist()


@pytest.mark.parametrize("async_batching", [False, True])
def test_continuations_of_one_context(model, async_batching):
    ctx = prompts_of_lengths([37], seed=70)[0]
    g = greedy_after(model, ctx, 3)
    conts = [[g[0]], [9], g, [g[0], 9, 10], [40, 41], [77]]  # one-token and longer, greedy and not
    cfg = acb.ContinuousBatchingConfig(**CFG, use_async_batching=async_batching)
    with acb.Engine(model, cfg) as eng:
        out = eng.score(ctx, conts, top_logprobs=3)
        plain = eng.score(ctx, conts)
        assert eng.stats.generated_tokens == 0  # nothing was sampled
    check(model, out, ctx, conts, k=3)
    check(model, plain, ctx, conts)
    assert [s.greedy for s in out.continuations] == [True, False, True, False, False, False]
    # one group: the context request (it scores the one-token continuations and every first
    # token) and three children forked from it, one per distinct body (g[:2], [g[0], 9], [40]);
    # the second call found the context's full blocks cached (the children read the context
    # request's blocks, not the cache)
    assert out.num_cached_tokens == 0 and plain.num_cached_tokens == 36 // 8 * 8


@pytest.mark.parametrize("async_batching", [False, True])
def test_a_context_longer_than_a_prefill_chunk_and_a_cached_preamble(model, async_batching):
    """Five "few-shot" contexts share a 64-token preamble: it is computed once (the others read it
    from the cache); contexts are longer than max_batch_tokens (chunked prefill)."""
    pre = prompts_of_lengths([64], seed=71)[0]
    tails = prompts_of_lengths([5, 9, 3, 12, 7], seed=72)
    items = [(pre + t, [[11], [12], [13, 14, 15]]) for t in tails]
    cfg = acb.ContinuousBatchingConfig(**CFG, max_batch_tokens=16, use_async_batching=async_batching)
    with acb.Engine(model, cfg) as eng:
        outs = eng.score_batch(items, progress_bar=False)
        stats = eng.stats
    for (ctx, conts), out in zip(items, outs):
        check(model, out, ctx, conts)
    # one group per context; all but the first context request read the preamble's 8 full
    # blocks, and every context is prefilled once (its children compute their own tokens only)
    assert sum(o.num_cached_tokens for o in outs) >= 4 * 64
    assert stats.prefill_tokens <= 64 + sum(len(t) + 7 + 2 for t in tails)


@pytest.mark.parametrize("offload", [0.0, 0.01])
@pytest.mark.parametrize("async_batching", [False, True])
def test_preemption_under_a_tiny_cache(model, async_batching, offload):
    """Generations growing beside the scoring requests take the blocks: the newest running
    requests (scoring ones) are preempted, recomputed or offloaded, and score the same."""
    from tests.conftest import reference_generate

    contexts = prompts_of_lengths([30, 41, 25, 52, 33, 47], seed=73)
    items = [(c, [[5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [16]]) for c in contexts]
    refs = [reference_generate(model, c[:10], 50) for c in contexts[:3]]
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=24, max_batch_tokens=48, use_async_batching=async_batching, cpu_offload_space=offload
    )
    with acb.Engine(model, cfg) as eng:
        gens = [eng.submit(c[:10], max_new_tokens=50) for c in contexts[:3]]
        outs = eng.score_batch(items, progress_bar=False)
        assert [g.result(60).generated_tokens for g in gens] == refs
        assert eng.stats.preemptions > 0
        if offload:
            assert eng.stats.swapped_out_blocks > 0
    for (ctx, conts), out in zip(items, outs):
        check(model, out, ctx, conts)


def test_the_lm_head_runs_on_the_scored_rows_alone(model):
    """3 rows for a 60-token context with continuations [a] and [b, c, d]: the context's last row
    (it scores a and b), then the rows after b and c (they score c and d); none for the other 59
    positions, and no position computed twice. At most ``max_scored_rows`` rows in one step."""
    head = model.get_output_embeddings()
    calls: list[int] = []
    hook = head.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[-2]))
    try:
        ctx = prompts_of_lengths([60], seed=74)[0]
        with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
            eng.score(ctx, [[5], [6, 7, 8]])
            assert sum(calls) == 3 and eng.stats.prefill_tokens == 62
            calls.clear()
            eng.call(lambda c: setattr(c.scheduler, "max_scored_rows", 5)).result()
            long = prompts_of_lengths([40], seed=75)[0]
            out = eng.score(ctx, [long])
            assert max(calls) <= 5 and sum(calls) == 40
    finally:
        hook.remove()
    check(model, out, ctx, [long])


async def test_async_score_and_cancellation(model):
    ctx = prompts_of_lengths([20], seed=76)[0]
    async with acb.AsyncEngine(model, acb.ContinuousBatchingConfig(**CFG, use_async_batching=True)) as eng:
        out = await eng.score(ctx, [[3], [4, 5]], top_logprobs=1)
        check(model, out, ctx, [[3], [4, 5]], k=1)
        outs = await eng.score_batch([(ctx, [[3]]), (ctx[:5], [[7, 8]])])
        check(model, outs[1], ctx[:5], [[7, 8]])
        # a score awaited by a task that is cancelled: its engine requests end
        import asyncio

        gate = threading.Event()
        eng.core.call(lambda c: gate.wait(HANG_GUARD))
        task = asyncio.ensure_future(eng.score(ctx, [[3], [4, 5]]))
        await eventually(lambda: eng.ids.live, "the score's engine requests are submitted")
        task.cancel()  # (the engine is held: they cannot have ended)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: not eng.ids.live, "the cancelled score's engine requests end")


def test_bad_scoring_input_is_refused(model):
    with acb.Engine(model, acb.ContinuousBatchingConfig(**CFG)) as eng:
        limit = eng.config.max_model_len
        for args, kw, exc, match in (
            (([], [[1]]), {}, ValueError, "context is empty"),
            (([1, 2], []), {}, ValueError, "at least one continuation"),
            (([1, 2], [[]]), {}, ValueError, r"continuations\[0\] is empty"),
            (([1, 2], [[300]]), {}, ValueError, "outside the model's vocabulary"),
            (([1, 2], [[3]]), {"top_logprobs": 21}, ValueError, "top_logprobs"),
            (("text", [[3]]), {}, TypeError, "no tokenizer"),
            (([1, 2], [3]), {}, TypeError, "must be a sequence of ints|must hold ints"),
            (([3 + (i % 200) for i in range(limit)], [[3, 4]]), {}, ValueError, "can never fit"),
        ):
            with pytest.raises(exc, match=match):
                eng.score(*args, **kw)
        assert not eng.ids.live
        # the longest windows that fit: a context of limit tokens and a continuation of 1; a
        # continuation of 2 forks a child from the context request, which then needs the context's
        # full blocks and two partial ones: 61 * 8 + 7 = 495 context tokens in 63 blocks
        assert limit == 63 * 8
        ctx = [3 + (i % 200) for i in range(limit)]
        out = eng.score(ctx, [[5]])
        ctx2 = ctx[:495]
        out2 = eng.score(ctx2, [[5, 6]])
        with pytest.raises(ValueError, match="fork from the context's KV"):  # 62 full blocks + 2 partial > 63
            eng.score(ctx[:502], [[5, 6]])
    check(model, out, ctx, [[5]])
    check(model, out2, ctx2, [[5, 6]])


@pytest.mark.parametrize("async_batching", [False, True])
def test_one_request_per_batch_scores_every_continuation(model, async_batching):
    """``max_requests_per_batch=1``: no row for a child beside its context request, so each
    continuation of two or more tokens is a request of its own (context + its body, scored from the
    context's last row), run one after another; the context's full blocks come from the prefix
    cache. A cache of 12 blocks of 4: the requests' blocks are reclaimed from the cache between them."""
    ctx = prompts_of_lengths([23], seed=77)[0]
    g = greedy_after(model, ctx, 3)
    conts = [[g[0]], g, [g[0], 9, 10], [40, 41], [77], [5, 6, 7, 8, 9, 10]]
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=12, max_requests_per_batch=1, use_async_batching=async_batching
    )
    with acb.Engine(model, cfg) as eng:
        out = eng.score(ctx, conts, top_logprobs=2)
        again = eng.score_batch([(ctx, conts), (ctx[:7], [[3, 4]])], progress_bar=False)
        assert eng.stats.generated_tokens == 0
    check(model, out, ctx, conts, k=2)
    check(model, again[0], ctx, conts)
    check(model, again[1], ctx[:7], [[3, 4]])
    assert [s.greedy for s in out.continuations] == [True, True, False, False, False, False]
    assert again[0].num_cached_tokens >= 5 * (len(ctx) // 4 * 4)  # every request read the context's blocks


@pytest.mark.parametrize("rows", [1, 2])
def test_a_scoring_group_too_wide_for_the_rows_is_refused(model, rows):
    """A scoring group (a context request and the children forked from it) holds one row per
    request from its admission on: handed to the input processor with more requests than
    ``max_requests_per_batch`` (``Engine.score`` never plans one), it is a ``ValueError`` about the
    continuations, which says so in scoring's words (not the ``n`` samples' refusal); nothing is
    left behind. ``Engine.score`` of the same continuations plans groups that fit and scores them."""
    from acb.api.scoring import make_score_request, plan
    from acb.api.sinks import ThreadSink

    ctx = prompts_of_lengths([13], seed=78)[0]
    conts = [[3], [4, 5, 6], [4, 5, 7], [8, 9]]  # two children: a group of 3 requests, unless split
    (group,) = plan(ctx, conts, 0)  # (no max_group: one group, wider than the rows)
    assert len(group) == 3
    cfg = acb.ContinuousBatchingConfig(page_size=4, num_blocks=32, max_requests_per_batch=rows)
    with acb.Engine(model, cfg) as eng:
        with pytest.raises(ValueError) as info:
            make_score_request(eng, [m.target for m in group], 0, sink_factory=ThreadSink, request_id="wide")
        assert isinstance(info.value, acb.InvalidRequestError) and info.value.field == "continuations"
        message = str(info.value)
        assert message == (
            f"a scoring request with 2 forked continuation(s) runs 3 requests side by side, but "
            f"max_requests_per_batch is {rows}: give it at most {rows - 1} score_children "
            "(Engine.score plans groups that fit)"
        )
        assert "samples" not in message  # (not the refusal of n=2 samples)
        assert not eng.ids.live  # the id was never claimed: it can be used
        out = eng.score(ctx, conts, request_id="wide")
    check(model, out, ctx, conts)
