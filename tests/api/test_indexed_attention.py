"""Indexed sparse attention (DSA: DeepSeek V3.2, GLM-5 DSA, Hunyuan V4, AXK2) and DeepSeek V4's
compressed sparse attention exact against
``model.generate``: each layer's indexer picks the top-k cached tokens a query attends to; acb
pages the indexers' keys beside K/V and runs the model's own indexer per request
(``acb.runner.indexed``).

The tiny configs are the catalogue sweep's (``benchmarks/model_sweep.py``): ``index_topk=4``, so
that every prompt past four tokens attends to a selection (the check below proves the selection
changes the tokens), and GLM-5 / Hunyuan V4 keep a layer that reuses the previous indexer's
selection (``indexer_types`` ``"shared"``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from acb.runner.kv_cache import INDEX_KEYS
from tests.conftest import assert_scores_match_forward, prompts_of_lengths, reference_generate
from tests.test_model_sweep import ms

ARCHS = ["axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4"]
MAX_NEW = 6


@functools.cache
def model_of(arch: str, topk: int | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = ms.tiny_config(arch)
    if topk is not None:
        config.index_topk = topk
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@functools.cache
def reference(arch: str, prompt: tuple[int, ...], topk: int | None = None) -> list[int]:
    """Greedy tokens of plain ``model.generate`` on one unpadded prompt, EOS not stopping it."""
    with torch.no_grad():
        out = model_of(arch, topk).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def prompts(lengths, seed=1):
    return prompts_of_lengths(lengths, vocab=256, seed=seed)


def run(eng, ps, **kw):
    return [
        o.generated_tokens
        for o in eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False, **kw).values()
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_indexers_are_found_and_their_keys_paged(arch):
    """The engine drives every indexer (found by the cache method it calls), gives each a
    key-only cache layer of one key per token, and runs the torch reference backend."""
    model = model_of(arch)
    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    ids = torch.tensor([prompts([12])[0]])
    with torch.no_grad():
        before = model(ids).logits
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8)) as eng:
        with torch.no_grad():  # the user's own forward meanwhile (a trainer's): the model's sparse attention
            assert torch.equal(model(ids).logits, before)
        runner = eng.runner
        assert runner.indexed is not None and runner.indexed.layers == indexers
        spec = runner.kv_cache.spec
        assert spec.index_layers == tuple(m.layer_idx for m in indexers)
        width = indexers[0].head_dim
        index_layers = spec.layers_of(INDEX_KEYS)
        keys = [runner.kv_cache.k[c] for c in index_layers]
        assert [tuple(t.shape) for t in keys] == [(16, 8, 1, width)] * len(indexers)
        assert all(runner.kv_cache.v[c].numel() == 0 for c in index_layers)
        assert spec.bytes_per_token()["index keys"] == len(indexers) * width * 4
        assert spec.bytes_per_block(8) == sum(t.nbytes for t in runner.kv_cache.k + runner.kv_cache.v) // 16
        assert (
            runner.cfg.attn_backend in ("torch", "cpu") and not runner.cfg.cuda_graphs
        )  # cpu: its indexed layers on torch's path


def test_the_selection_changes_the_tokens():
    """The parity below proves something: with every token selected (a top-k past the prompts'
    lengths) ``model.generate`` gives other tokens than with the tiny configs' top-4."""
    ps = prompts([17, 30, 9])
    for arch in ARCHS:
        assert any(reference(arch, tuple(p)) != reference(arch, tuple(p), 2048) for p in ps), arch


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_batch_tokens=8),  # chunked prefill: the indexer scores a chunk against earlier pages
        dict(num_blocks=12, page_size=4, max_batch_tokens=16, use_async_batching=True),  # preemption, async
        # offload under preemption: the indexer keys go out and back with the K/V
        dict(num_blocks=13, page_size=4, safety_margin=0.0, cpu_offload_space=0.01),
    ],
    ids=["whole", "chunked", "preempt-async", "offload"],
)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity(arch, cfg):
    ps = prompts([5, 17, 30, 9, 22])
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **cfg})
    with acb.Engine(model_of(arch), config) as eng:
        got = run(eng, ps)
        stats = eng.stats
        if "num_blocks" in cfg:
            assert stats.preemptions > 0
        if "cpu_offload_space" in cfg:
            assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0, stats
    assert got == [reference(arch, tuple(p)) for p in ps]


@pytest.mark.parametrize("arch", ARCHS)
def test_requests_within_the_top_k_share_one_indexer_call(arch, monkeypatch):
    """With every context within the indexer's top-k (a real DSA model's 2,048 covers most
    requests), a step's segments go through each indexer in one padded call: fresh prompts,
    chunks after earlier pages and decode rows together, exact against ``model.generate``, also
    chunked, under preemption with async batching, with a prefix hit and with n > 1; a context
    past the top-k takes a call of its own (the 40-token prompt, top-k 32)."""
    from acb.runner import indexed

    calls = {"shared": 0, "alone": 0}
    batch, single = indexed._batch_call, indexed._segment_call

    def shared(*a, **k):
        calls["shared"] += 1
        return batch(*a, **k)

    def alone(*a, **k):
        calls["alone"] += 1
        return single(*a, **k)

    monkeypatch.setattr(indexed, "_batch_call", shared)
    monkeypatch.setattr(indexed, "_segment_call", alone)
    ps = prompts([5, 17, 24, 9, 22, 40])
    for cfg in (
        dict(num_blocks=64, page_size=8, max_batch_tokens=24),
        dict(num_blocks=14, page_size=4, max_batch_tokens=16, use_async_batching=True),
    ):
        with acb.Engine(model_of(arch, 32), acb.ContinuousBatchingConfig(allow_block_sharing=True, **cfg)) as eng:
            assert run(eng, ps) == [reference(arch, tuple(p), 32) for p in ps]
            if cfg["num_blocks"] == 14:
                assert eng.stats.preemptions > 0
            else:
                out = eng.generate(ps[1][:16] + ps[2][:4], max_new_tokens=MAX_NEW, ignore_eos=True, n=2)
                assert eng.stats.prefix_hits > 0
                assert [x.generated_tokens for x in out.samples] == [
                    reference(arch, tuple(ps[1][:16] + ps[2][:4]), 32)
                ] * 2
    assert calls["shared"] > 0 and calls["alone"] > 0, calls


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_prefix_cache_samples_scoring_cancel_and_sleep(arch):
    """A cached prefix brings its indexer keys (the second request reuses the first's pages);
    n = 3 samples share the prompt's pages; scoring equals a plain forward's log-softmax; a
    request cancelled mid-prefill leaves nothing behind; sleep / wake recomputes exactly."""
    model = model_of(arch)
    ps = prompts([23, 7], seed=2)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=8, allow_block_sharing=True)
    with acb.Engine(model, cfg) as eng:
        first = eng.generate(ps[0], max_new_tokens=MAX_NEW, ignore_eos=True)
        again = eng.generate(ps[0][:20] + ps[1][:5], max_new_tokens=MAX_NEW, ignore_eos=True)
        assert eng.stats.prefix_hits > 0
        assert first.generated_tokens == reference(arch, tuple(ps[0]))
        assert again.generated_tokens == reference(arch, tuple(ps[0][:20] + ps[1][:5]))
        out = eng.generate(ps[1], max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
        assert [s.generated_tokens for s in out.samples] == [reference(arch, tuple(ps[1]))] * 3
        context, conts = ps[0][:11], [ps[1][:3], ps[1][3:4]]
        assert_scores_match_forward(eng, model, context, conts)
        long = prompts([90], seed=5)[0]
        h = eng.submit(long, max_new_tokens=MAX_NEW, ignore_eos=True)

        def computed(core) -> int:  # (on the engine thread, between two steps)
            return next((r.num_computed_tokens for r in core.scheduler.running if r.request_id == h.request_id), 0)

        while not 0 < eng.call(computed).result(timeout=120) < len(long):
            pass
        h.cancel()
        assert h.result(timeout=120).status == acb.RequestStatus.CANCELLED
        hs = [eng.submit(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in ps]
        eng.sleep()
        eng.wake_up()
        assert [x.result(timeout=120).generated_tokens for x in hs] == [reference(arch, tuple(p)) for p in ps]


def test_another_backend_is_refused_by_name():
    """The selection is applied by the torch backend only: asking for another says so."""
    with pytest.raises(ValueError, match="indexed sparse attention"):
        acb.Engine(model_of("deepseek_v32"), acb.ContinuousBatchingConfig(num_blocks=16, attn_backend="triton")).start()


# --- DeepSeek V4: compressed (sparse) attention on the model's own cache, per request -----------------


def test_deepseek_v4_layers_run_on_their_own_cache():
    """Every attention layer (sliding-only, CSA, HCA) runs on the model's own cache object per
    request: no KV pages, no prefix caching or offload; the caches go with their requests."""
    model = model_of("deepseek_v4")
    cfg = acb.ContinuousBatchingConfig(num_blocks=16, page_size=8, allow_block_sharing=True, cpu_offload_space=0.01)
    with acb.Engine(model, cfg) as eng:
        runner = eng.runner
        assert [m.layer_idx for m in runner.unpaged.layers] == [0, 1, 2, 3]
        assert runner.kv_cache.k == [] and runner.kv_cache.spec.num_layers == 0
        # the blocks are sized by what a token costs the model's own caches, measured at start: a
        # pooled entry per compress_rate tokens (CSA: the compressor's and its indexer's; HCA: one)
        c = model.config
        rates, types = c.compress_rates, c.layer_types
        per_token = sum(
            (c.head_dim + c.index_head_dim) / rates[t] if t == "compressed_sparse_attention" else c.head_dim / rates[t]
            for t in types
            if t in rates
        )
        assert runner.kv_cache.spec.bytes_per_token() == {"unpaged": int(per_token * 4)}
        assert not runner.cfg.prefix_caching and runner.cfg.num_swap_blocks == 0
        run(eng, prompts([19, 6, 11]))
        # the next step frees the finished requests' rows, and their caches with them
        eng.generate(prompts([4])[0], max_new_tokens=2, ignore_eos=True)
        assert eng.call(lambda core: len(runner.unpaged_caches.rows)).result(timeout=60) <= 1


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_batch_tokens=8),  # chunked prefill: the compressor's buffer and overlap carried across chunks
        dict(num_blocks=12, page_size=4, max_batch_tokens=16, use_async_batching=True),  # preemption, async
    ],
    ids=["whole", "chunked", "preempt-async"],
)
def test_deepseek_v4_greedy_parity(cfg):
    ps = prompts([5, 17, 30, 9, 22])
    config = acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **cfg})
    with acb.Engine(model_of("deepseek_v4"), config) as eng:
        got = run(eng, ps)
        if "num_blocks" in cfg:
            assert eng.stats.preemptions > 0
    assert got == [reference("deepseek_v4", tuple(p)) for p in ps]


def test_deepseek_v4_compression_and_selection_change_the_tokens():
    """The parity above proves something: a wider sliding window, or an indexer keeping every
    pooled entry, gives other tokens than the tiny config's."""
    from transformers import AutoModelForCausalLM

    ps = prompts([17, 30, 22])
    base = [reference("deepseek_v4", tuple(p)) for p in ps]
    for field, value in (("sliding_window", 64), ("index_topk", 512)):
        config = ms.tiny_config("deepseek_v4")
        setattr(config, field, value)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            other = [
                model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)[
                    0, len(p) :
                ].tolist()
                for p in ps
            ]
        assert other != base, field


def test_deepseek_v4_samples_scoring_cancel_and_sleep():
    model = model_of("deepseek_v4")
    ps = prompts([23, 7], seed=2)
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=8)
    with acb.Engine(model, cfg) as eng:
        out = eng.generate(ps[0], max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
        assert [s.generated_tokens for s in out.samples] == [reference("deepseek_v4", tuple(ps[0]))] * 3
        context, conts = ps[0][:11], [ps[1][:3], ps[1][3:4]]
        assert_scores_match_forward(eng, model, context, conts)
        long = prompts([90], seed=5)[0]
        h = eng.submit(long, max_new_tokens=MAX_NEW, ignore_eos=True)

        def computed(core) -> int:  # (on the engine thread, between two steps)
            return next((r.num_computed_tokens for r in core.scheduler.running if r.request_id == h.request_id), 0)

        while not 0 < eng.call(computed).result(timeout=120) < len(long):
            pass
        h.cancel()
        assert h.result(timeout=120).status == acb.RequestStatus.CANCELLED
        hs = [eng.submit(p, max_new_tokens=MAX_NEW, ignore_eos=True) for p in ps]
        eng.sleep()
        assert eng.runner.unpaged_caches.rows == {}
        eng.wake_up()
        assert [x.result(timeout=120).generated_tokens for x in hs] == [reference("deepseek_v4", tuple(p)) for p in ps]


def test_fold_selection_masks_what_the_indexer_left_out():
    """Outside a step the selection is folded into the model's own mask: a bool mask keeps the
    selected keys it allowed, a float mask gets its minimum elsewhere, and no mask means causal."""
    from acb.runner.attention import fold_selection

    index = torch.tensor([[[0, 1], [1, 2], [0, 2]]])  # [1, 3 queries, k=2] over 3 keys
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    picked = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.bool)
    assert torch.equal(fold_selection(None, index, 3, torch.float32)[0, 0], causal & picked)
    assert torch.equal(fold_selection(causal[None, None], index, 3, torch.float32)[0, 0], causal & picked)
    additive = torch.zeros(1, 1, 3, 3)
    folded = fold_selection(additive, index, 3, torch.float32)[0, 0]
    assert torch.equal(folded == 0, picked) and torch.all(folded[~picked] == torch.finfo(torch.float32).min)


@functools.cache
def tied_model(arch: str) -> torch.nn.Module:
    """Two index heads: a key whose dot products with both are negative scores exactly 0 (ReLU), so
    the top-k cutoff often falls in a tie."""
    from transformers import AutoModelForCausalLM

    config = ms.tiny_config(arch)
    config.index_n_heads, config.index_topk = 2, 16
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("first", ["exactly", "longer"])
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_a_prefix_hit_is_transformers_own_reuse_of_the_prefix_cache(arch, first):
    """Issue 52 item 1. Where the top-k cutoff is a tie, ``torch.topk`` breaks it by the row's
    length, so transformers' own model selects other keys for a cached position when the prompt
    is longer: ``model.generate`` on a whole prompt and ``model.generate`` resumed from the cache
    its prefix filled disagree (asserted below: the comparison is not vacuous). A prefix hit in
    acb is exactly the second, transformers' own reuse of the prefix's cache: the model's indexer
    runs on the same rows (the cached positions as the prefix's request computed them, the new
    ones over the whole context). Without ties (the other tests' 64 index heads, a checkpoint's)
    the two references agree and acb equals both."""
    import copy

    from transformers import DynamicCache

    model = tied_model(arch)
    prefix = prompts([40], seed=101)[0]  # five whole blocks of 8
    prompts_ = [prefix + t for t in prompts([3, 9, 17], seed=201)]
    head = prefix if first == "exactly" else prefix + prompts([5], seed=9)[0]  # the first request's prompt
    filled = DynamicCache(config=model.config)  # what the first request's forward leaves, cut to the prefix's blocks
    with torch.no_grad():
        model(torch.tensor([head]), past_key_values=filled, use_cache=True)
    if len(head) > len(prefix):
        filled.crop(len(prefix) - len(head))  # (a negative count: the tokens to drop)

    resumed = [reference_generate(model, p, MAX_NEW, ignore_eos=True, cache=copy.deepcopy(filled)) for p in prompts_]
    assert resumed != [
        reference_generate(model, p, MAX_NEW, ignore_eos=True) for p in prompts_
    ]  # transformers' own two answers differ
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=64, page_size=8, allow_block_sharing=True, use_async_batching=first == "longer"
    )
    with acb.Engine(model, cfg) as eng:
        eng.generate(head, max_new_tokens=1, ignore_eos=True)
        outs = list(eng.generate_batch(prompts_, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False).values())
    assert [o.num_cached_tokens for o in outs] == [40] * 3
    assert [o.generated_tokens for o in outs] == resumed
