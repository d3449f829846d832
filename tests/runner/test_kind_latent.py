"""An MLA attention layer paged as its latent (``acb.runner.latent``), at the layer: what its pages
cost, and its module run inside engine steps over latent pages against the same module on a
``DynamicCache`` (transformers caching the latent, ``expand_kv`` over the whole context: what
``model.generate`` does), for each way acb attends the latent (B1: the module's ``expand_kv`` over the
gathered latent; B3: the absorbed query over the latent as one head), on the torch and CPU backends.
"""

from __future__ import annotations

import functools

import pytest
import torch

from acb.runner import latent
from acb.runner.attention import (
    ATTN_IMPL_NAME,
    BatchInputs,
    StepContext,
    make_backend,
    register_with_transformers,
    set_own_implementation,
    step_context,
)
from acb.runner.attention.torch_backend import TorchBackend, absorbs_chunk
from acb.runner.kv_cache import KVCache
from acb.runner.setup import kv_spec_of
from tests.test_model_sweep import ms

BS = 4  # page size


@functools.cache
def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = ms.tiny_config("deepseek_v3")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_latent_page_holds_rank_plus_rope_values_per_token_and_layer(dtype):
    model = _model()
    mods = latent.latent_modules(model)
    widths = {i: m.kv_lora_rank + m.qk_rope_head_dim for i, m in mods.items()}
    spec = kv_spec_of(model, dtype, latent=True)
    elem = torch.finfo(dtype).bits // 8
    assert spec.latent_layers == tuple(sorted(mods))
    assert [spec.shape_of(c) for c in spec.latent_layers] == [(1, widths[i]) for i in sorted(mods)]
    assert spec.bytes_per_token() == {"latent": sum(widths.values()) * elem}
    cache = KVCache(spec, 6, BS, torch.device("cpu"))
    for c in spec.latent_layers:
        assert tuple(cache.k[c].shape) == (6, BS, 1, spec.shape_of(c)[1]) and cache.k[c].dtype == dtype
        assert cache.v[c].numel() == 0  # no values: the latent is both
    assert sum(t.nbytes for t in cache.k + cache.v) == 6 * spec.bytes_per_block(BS)
    assert spec.bytes_per_block(BS) == BS * sum(widths.values()) * elem


def _batch(seqs: list[tuple[int, int]], table: torch.Tensor) -> BatchInputs:
    """A step of ``(start, num_new)`` per sequence, sequence ``i`` on block-table row ``i``."""
    slots = [int(table[i, p // BS]) * BS + p % BS for i, (s, n) in enumerate(seqs) for p in range(s, s + n)]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    return BatchInputs(
        slot_mapping=torch.tensor(slots),
        block_table=table[: len(seqs)],
        seq_lens=torch.tensor([s + n for s, n in seqs]),
        query_start_loc=torch.tensor(qsl),
        num_new=[n for _, n in seqs],
        start_pos=[s for s, _ in seqs],
        max_seq_len=max(s + n for s, n in seqs),
    )


# two sequences over three steps: fresh prompts (B's first part), then A's first decode row beside B's
# short chunk after its cached prefix, then a decode row each
STEPS = [[(0, 9), (0, 12)], [(9, 1), (12, 5)], [(10, 1), (17, 1)]]


def _reference(attn, rotary, hidden: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Each sequence's outputs, step by step, from the module on a DynamicCache (the model's own SDPA),
    and the latent ``[kv_nope | k_rot]`` that cache holds at the end."""
    from transformers import DynamicCache

    outs: list[list[torch.Tensor]] = []
    latents: list[torch.Tensor] = []
    for i, h in enumerate(hidden):
        cache = DynamicCache()
        mine = []
        for step in STEPS:
            s, n = step[i]
            x = h[s : s + n][None]
            mask = torch.ones(n, s + n, dtype=torch.bool).tril(s)[None, None]
            o, _ = attn(x, rotary(x, torch.arange(s, s + n)[None]), mask, past_key_values=cache)
            mine.append(o[0])
        outs.append(mine)
        layer = cache.layers[attn.layer_idx]
        latents.append(torch.cat([layer.keys, layer.values], -1)[0, 0])
    return outs, latents


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("absorb", [True, False], ids=["B3", "B1"])
def test_the_module_in_engine_steps_over_latent_pages_matches_it_on_a_dynamic_cache(absorb, backend, monkeypatch):
    model = _model()
    attn = model.model.layers[0].self_attn
    rotary = model.model.rotary_emb
    lat_mod = latent.latent_modules(model)[0]
    assert lat_mod is attn
    g = torch.Generator().manual_seed(5)
    hidden = [
        torch.randn(11, model.config.hidden_size, generator=g),
        torch.randn(18, model.config.hidden_size, generator=g),
    ]
    with torch.no_grad():
        want, want_latent = _reference(attn, rotary, hidden)
        x = hidden[1][None]
        alone = attn(x, rotary(x, torch.arange(18)[None]), None)[0]  # outside any step, before the engine

    # which path each layer's rows took
    taken: list[str] = []
    for name in ("_decode_absorbed", "_prefill_absorbed"):
        original = getattr(TorchBackend, name)
        monkeypatch.setattr(
            TorchBackend, name, lambda self, *a, _o=original, _n=name, **k: (taken.append(_n), _o(self, *a, **k))[1]
        )
    spec = kv_spec_of(model, torch.float32, latent=True)
    cache = KVCache(spec, 16, BS, torch.device("cpu"))
    table = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]])  # block 0: scratch
    be = make_backend(backend)
    register_with_transformers()
    set_own_implementation([model.config], "sdpa")
    layers = latent.LatentLayers(model, absorb=absorb)
    model.set_attn_implementation(ATTN_IMPL_NAME)
    try:
        expand = getattr(attn, latent.LATENT_ATTR)
        assert expand.absorbs is absorb
        for k, step in enumerate(STEPS):
            batch = _batch(step, table)
            ctx = StepContext(cache, be, be.build_metadata(batch, BS))
            x = torch.cat([hidden[i][s : s + n] for i, (s, n) in enumerate(step)])[None]
            pos = torch.cat([torch.arange(s, s + n) for s, n in step])[None]
            with torch.no_grad(), step_context(ctx):
                got, _ = attn(x, rotary(x, pos), None, acb_ctx=ctx)
            a = 0
            for i, (_, n) in enumerate(step):
                ref = want[i][k]
                torch.testing.assert_close(got[0, a : a + n], ref, rtol=1e-5, atol=1e-5)
                assert torch.equal(got[0, a : a + n].argmax(-1), ref.argmax(-1))
                a += n
        for i, (s, n) in enumerate(STEPS[-1]):  # the pages hold what transformers' cache holds: the latent
            pos = torch.arange(s + n)
            pages = cache.flat_k(cache.layer_of(0))[table[i, pos // BS] * BS + pos % BS, 0]
            torch.testing.assert_close(pages, want_latent[i], rtol=1e-6, atol=1e-6)
        # outside a step the module is the model's own: the same output, bit for bit
        with torch.no_grad():
            x = hidden[1][None]
            assert torch.equal(attn(x, rotary(x, torch.arange(18)[None]), None)[0], alone)
    finally:
        model.set_attn_implementation("sdpa")
        layers.remove()
        set_own_implementation([model.config], None)
    assert "expand_kv" not in vars(attn) and latent.LATENT_ATTR not in vars(attn)
    # B3: every decode row and the short chunk absorbed (the chunk of 5 is short for these sizes); B1: none
    assert absorbs_chunk(expand, 5) is absorb
    assert taken == (["_decode_absorbed", "_prefill_absorbed", "_decode_absorbed"] if absorb else [])
