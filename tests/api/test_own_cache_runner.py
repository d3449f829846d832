"""The second runner path (``acb.runner.own_cache_runner``): models acb cannot page run on the model's
own cache objects, exact against ``model.generate``, behind the same engine, API and scheduler.

GPT-J (attention outside transformers' attention interface: decode rows batched with left
padding), Doge (a content-dependent mask acb's paged attention cannot take), Moshi (a
sliding-window cache: unbatched, prompts prefilled whole), ProphetNet (a cache that takes one
token at a time after the first call: found by the start-up try, prefilled whole), XLNet (its
own generation hooks: a preempted request's recompute replays ``model.generate``'s calls), and Llama
forced onto this path next to the paged one. Tiny configs are the catalogue sweep's. Prefix
caching cuts a copy of a request's cache at a block boundary where the cache is plain growing
K/V (GPT-J, Doge, Llama), and stays off where it is not (Moshi's window, ProphetNet, XLNet).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import acb
from acb.runner.kv_cache import UNPAGED
from tests.conftest import assert_scores_match_forward, prompts_of_lengths
from tests.test_model_sweep import ms

MAX_NEW = 6


@functools.cache
def model_of(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    return model


@functools.cache
def reference(arch: str, prompt: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model_of(arch).generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def prompts(lengths, seed=1):
    return prompts_of_lengths(lengths, vocab=256, seed=seed)


def run(eng, ps, **kw):
    outs = eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False, **kw)
    return [o.generated_tokens for o in outs.values()]


# arch -> (runner config, decode rows batched, prompts prefilled in chunks, prefix caching: the
# cache cut at a block boundary)
CASES = {
    "gptj": (None, True, True, True),
    "doge": (None, True, True, True),
    "moshi": (None, False, False, False),  # a sliding window: the keys before it are gone
    "prophetnet": (None, False, False, False),  # one token a call after the first: no resuming a prompt
    "xlnet": (None, False, False, False),  # its own hooks (a dummy token): a recompute is replayed call by call
    "llama": ("own_cache", True, True, True),
}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_the_path_is_chosen_at_start_and_said(arch, caplog):
    runner, batched, chunked, prefix = CASES[arch]
    with caplog.at_level(logging.INFO, logger="acb"):
        eng = acb.Engine(model_of(arch), acb.ContinuousBatchingConfig(num_blocks=32, page_size=8, runner=runner))
        eng.start()
    try:
        r = eng.runner
        assert r.own_cache_runner is not None
        assert r.own_cache_runner.batchable is batched and r.cfg.whole_prefill is not chunked
        assert r.own_cache_runner.group_chunks is (batched and chunked)  # chunks in padded groups: the try said so
        assert r.kv_cache.k == [] and r.kv_cache.spec.bytes_per_token()["unpaged"] > 0
        assert r.cfg.num_swap_blocks == 0 and not r.cfg.cuda_graphs
        # prefix caching where the start-up try cut a prompt and resumed it exactly; else off, and why
        assert r.cfg.prefix_caching is prefix and (r.cfg.state_snapshots > 0) is prefix
        uncut = [m for m in caplog.messages if "cannot be cut at a block boundary" in m]
        assert len(uncut) == (not prefix), uncut
        said = [m for m in caplog.messages if "runs on its own cache objects" in m]
        # one line, with the paged path's refusal as the reason (or the config's ask)
        why = said[0].split("not paged: ", 1)[1] if len(said) == 1 else ""
        assert why.startswith(type(r.model).__name__ if runner is None else "runner='own_cache'"), said
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_batch_tokens=8),  # chunked prefill (or whole prompts where the try said so)
        dict(num_blocks=12, page_size=4, max_batch_tokens=16, use_async_batching=True),  # preemption, async
    ],
    ids=["whole", "chunked", "preempt-async"],
)
@pytest.mark.parametrize("arch", sorted(CASES))
def test_greedy_parity(arch, cfg):
    ps = prompts([5, 17, 30, 9, 22])
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, "runner": CASES[arch][0], **cfg})
    with acb.Engine(model_of(arch), config) as eng:
        got = run(eng, ps)
        if "num_blocks" in cfg:
            assert eng.stats.preemptions > 0
    assert got == [reference(arch, tuple(p)) for p in ps]


@pytest.mark.parametrize("arch", ["llama", "moshi"])
def test_a_shared_prefix_is_reused_where_the_cache_can_be_cut(arch):
    """A 24-token prefix sent once, then extended by three prompts in one batch (prefilled together
    and chunked, or whole where the model needs it): where the cache can be cut (Llama's plain
    K/V), the three read three blocks from a copy of the first request's cache cut at the boundary;
    where not (Moshi's sliding window), nothing; every request gives ``model.generate``'s tokens
    either way. (GPT-J's reuse under samples, preemption, sleep and scoring:
    ``tests/api/test_prefix_reuse_kinds.py``.)"""
    head = prompts([24], seed=11)[0]
    ps = [head + tail for tail in prompts([3, 10, 1], seed=12)]
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=8, runner=CASES[arch][0], max_batch_tokens=16)
    with acb.Engine(model_of(arch), cfg) as eng:
        first = eng.generate(head, max_new_tokens=MAX_NEW, ignore_eos=True)
        outs = list(eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False).values())
    assert [o.num_cached_tokens for o in outs] == [24 if CASES[arch][3] else 0] * 3
    assert [o.generated_tokens for o in [first, *outs]] == [reference(arch, tuple(p)) for p in [head, *ps]]


def test_the_paged_path_refuses_what_it_cannot_page():
    with pytest.raises(acb.UnsupportedModelError, match="AttentionInterface"):
        acb.Engine(model_of("gptj"), acb.ContinuousBatchingConfig(num_blocks=16, runner="paged")).start()
    with pytest.raises(ValueError, match="runner"):
        acb.ContinuousBatchingConfig(runner="static")


@pytest.mark.parametrize("arch", ["gptj", "moshi"])
def test_samples_sampling_scoring_stops_cancel_and_sleep(arch):
    """n = 3 forks of the prompt's cache; seeded sampling reproducible; logprobs and scoring equal
    a plain forward's log-softmax; a stop string; a request cancelled mid-prefill leaves nothing
    behind; sleep / wake drops the caches and the requests recompute exactly."""
    model = model_of(arch)
    ps = prompts([23, 7], seed=2)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=8)
    with acb.Engine(model, cfg) as eng:
        out = eng.generate(ps[0], max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
        assert [s.generated_tokens for s in out.samples] == [reference(arch, tuple(ps[0]))] * 3
        a, b = (
            eng.generate(ps[1], max_new_tokens=MAX_NEW, ignore_eos=True, do_sample=True, temperature=1.0, seed=7)
            for _ in range(2)
        )
        assert a.generated_tokens == b.generated_tokens
        greedy = eng.generate(ps[1], max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        with torch.no_grad():
            full = torch.tensor([ps[1] + greedy.generated_tokens[:-1]])
            logits = model(full).logits[0, len(ps[1]) - 1 :].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(greedy.generated_tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(greedy.logprobs), want, atol=1e-4)
        context, conts = ps[0][:11], [ps[1][:3], ps[1][3:4]]
        assert_scores_match_forward(eng, model, context, conts)
        long = prompts([90], seed=5)[0]
        h = eng.submit(long, max_new_tokens=MAX_NEW, ignore_eos=True)

        def computed(core) -> int:  # (on the engine thread, between two steps)
            return next((r.num_computed_tokens for r in core.scheduler.running if r.request_id == h.request_id), 0)

        while not h.done and not 0 < eng.call(computed).result(timeout=120) < len(long):
            pass
        h.cancel()
        assert h.result(timeout=120).status in (acb.RequestStatus.CANCELLED, acb.RequestStatus.FINISHED)
        hs = [eng.submit(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in ps]
        eng.sleep()
        assert eng.runner.own_cache_runner.nbytes() == 0
        eng.wake_up()
        assert [x.result(timeout=120).generated_tokens for x in hs] == [reference(arch, tuple(p)) for p in ps]


def test_a_prompt_that_can_never_fit_is_refused_at_submit():
    """The blocks count the model's own cache: a request longer than the cache can hold is
    refused when submitted, naming the limit."""
    cfg = acb.ContinuousBatchingConfig(num_blocks=5, page_size=4)
    with acb.Engine(model_of("gptj"), cfg) as eng:
        spec = eng.runner.kv_cache.spec
        assert eng.runner.cfg.kv_cache_bytes == 5 * 4 * spec.bytes_per_token().get(
            UNPAGED, 0
        )  # blocks priced by the own cache
        with pytest.raises(ValueError, match="can never fit"):
            eng.generate(prompts([40])[0], max_new_tokens=2)


@pytest.mark.parametrize("arch", ["gptj", "llama"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_rows_join_and_leave_the_decode_batch_exactly(arch, use_async):
    """Requests of mixed prompt and output lengths, at most three at a time: rows leave the
    decode batch from its middle, longer prompts widen it, newcomers prefill in groups of like
    lengths, and every request's tokens are still ``model.generate``'s."""
    ps = prompts([3, 40, 7, 25, 12, 33, 5, 18, 44, 9], seed=4)
    news = [9, 2, 14, 5, 11, 3, 16, 7, 4, 12]
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=64, page_size=8, runner=CASES[arch][0], max_requests_per_batch=3, use_async_batching=use_async
    )
    with acb.Engine(model_of(arch), cfg) as eng:
        assert eng.runner.own_cache_runner.batchable
        params = [acb.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
        got = [o.generated_tokens for o in eng.generate_batch(ps, params, progress_bar=False).values()]
    with torch.no_grad():
        want = [
            model_of(arch).generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
            for p, n in zip(ps, news)
        ]
    assert got == want


def test_the_decode_batch_keeps_each_row_as_its_own_cache():
    """The decode batch's bookkeeping against plain per-row tensors, over random joins (wider and
    narrower than the batch), appended steps, rows leaving from anywhere and rows taken out:
    every row's keys and values, its padding (zeros, masked) and the trimmed width."""
    from transformers import DynamicCache

    from acb.runner.own_cache_runner import _DecodeBatch

    g = torch.Generator().manual_seed(0)
    layers, heads, dim = 2, 2, 3
    ref: dict[int, list[torch.Tensor]] = {}  # row -> per layer [heads, len, 2 * dim] (keys | values)
    batch, next_row = None, 0

    def check() -> None:
        if batch is None:
            assert not ref
            return
        assert sorted(batch.rows) == sorted(ref) and min(batch.pads) == 0
        mask = batch.mask(torch.device("cpu"))
        for i, (row, pad) in enumerate(zip(batch.rows, batch.pads)):
            assert mask[i].tolist() == [0] * pad + [1] * (batch.width + 1 - pad)
            for n, layer in enumerate(batch.cache.layers):
                kv = torch.cat([layer.keys[i], layer.values[i]], dim=-1)
                assert kv.shape[1] == batch.width
                assert torch.equal(kv[:, pad:], ref[row][n]) and not kv[:, :pad].any()

    for _ in range(300):
        op = int(torch.randint(4, (1,), generator=g))
        if op == 0 or batch is None:  # a left-padded batch of 1-3 new rows joins
            lens = torch.randint(1, 30, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            width, cache = max(lens), DynamicCache()
            for n in range(layers):
                kv = torch.randn(len(lens), heads, width, 2 * dim, generator=g)
                for i, w in enumerate(lens):
                    kv[i, :, : width - w] = 0
                cache.update(kv[..., :dim].contiguous(), kv[..., dim:].contiguous(), n)
                for i, w in enumerate(lens):
                    ref.setdefault(next_row + i, []).append(kv[i, :, width - w :])
            rows = list(range(next_row, next_row + len(lens)))
            next_row += len(lens)
            if batch is None:
                batch = _DecodeBatch(cache)
            batch.add(cache, [width - w for w in lens], rows)
        elif op == 1:  # a decode step appends a column to every row
            for n, layer in enumerate(batch.cache.layers):
                kv = torch.randn(len(batch.rows), heads, 1, 2 * dim, generator=g)
                layer.update(kv[..., :dim].contiguous(), kv[..., dim:].contiguous())
                for i, row in enumerate(batch.rows):
                    ref[row][n] = torch.cat([ref[row][n], kv[i]], dim=1)
        elif op == 2:  # some rows leave
            k = int(torch.randint(1, len(batch.rows) + 1, (1,), generator=g))
            gone = [batch.rows[int(i)] for i in torch.randperm(len(batch.rows), generator=g)[:k]]
            batch.remove(gone)
            for row in gone:
                del ref[row]
        else:  # a row is taken out, as its own cache
            row = batch.rows[int(torch.randint(len(batch.rows), (1,), generator=g))]
            own = batch.take(row, batch.cache)
            for n, layer in enumerate(own.layers):
                assert torch.equal(torch.cat([layer.keys[0], layer.values[0]], dim=-1), ref[row][n])
            del ref[row]
        if batch is not None and not batch.rows:
            batch = None
        check()


@pytest.mark.parametrize("arch", ["gptj", "llama"])
def test_prefill_chunks_run_in_padded_groups_exactly(arch, monkeypatch):
    """Prompts longer than a step's budget, preempted, under async batching: a prompt's first
    chunk and its later chunks (going on from its own cache, stacked left-padded before the new
    tokens) run in the step's left-padded prefill groups next to new prompts, and every request's
    tokens are still ``model.generate``'s."""
    from acb.runner.own_cache_runner import OwnCacheRunner

    groups: list[list[tuple[bool, bool]]] = []  # per group: (goes on from a cache, a logit wanted) per row
    spied = OwnCacheRunner._prefill_batch

    def spy(self, group, input_ids, want, out):
        groups.append([(row in self.single, bool(want.get(row))) for _, _, row in group])
        return spied(self, group, input_ids, want, out)

    monkeypatch.setattr(OwnCacheRunner, "_prefill_batch", spy)
    ps = prompts([23, 5, 30, 12, 37, 9, 19], seed=6)
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=14, page_size=4, max_batch_tokens=16, runner=CASES[arch][0], use_async_batching=True
    )
    with acb.Engine(model_of(arch), cfg) as eng:
        got = run(eng, ps)
        assert eng.stats.preemptions > 0
    assert got == [reference(arch, tuple(p)) for p in ps]
    rows = [r for g in groups if len(g) > 1 for r in g]
    assert (True, True) in rows and (False, False) in rows, groups  # a resumed chunk, a first chunk
