"""Multi-head latent attention paged as its latent (``acb.runner.latent``, issue 53 item 4): an MLA
layer's cache layer holds ``kv_lora_rank + qk_rope_head_dim`` values per token, not its expanded
heads, and the tokens stay ``model.generate``'s. Every MLA family of the catalogue that runs on
the paged path (the sweep's tiny configs); chunked prefill, preemption with async batching and
offload, prefix reuse and ``n > 1`` are run for DeepSeek V3 here and by
``test_prefix_reuse_kinds.py`` / ``test_indexed_attention.py`` (V3.2, GLM-5 DSA) and the sweep.
"""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from acb.runner import latent
from acb.runner.latent import latent_modules
from acb.runner.setup import kv_spec_of
from tests.conftest import prompts_of_lengths, reference_generate
from tests.test_model_sweep import ms

# the catalogue's MLA families on the paged path (dots3_note runs on the model's own cache)
ARCHS = [
    "axk1",
    "axk2",
    "bailing_hybrid",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "hy_v4",
    "kimi_linear",
    "longcat_flash",
    "minicpm3",
    "youtu",
]
MAX_NEW = 5


@functools.cache
def model_of(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()


@pytest.mark.parametrize("absorb", [True, False], ids=["B3", "B1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_latent_is_paged_and_exact(arch, absorb, monkeypatch):
    """Each MLA layer's cache layer is key-only, ``(1, r + rope)`` wide: what a token costs there is
    ``(r + rope) * 4`` bytes in float32, and what is allocated is that. The model's own forward
    meanwhile (a trainer's) and after the engine is its own; the tokens are ``model.generate``'s,
    with the decode rows and short chunks absorbed (B3, the default) and with every query attending
    the expanded latent (B1)."""
    monkeypatch.setattr(latent, "ABSORB", absorb)
    model = model_of(arch)
    mods = latent_modules(model)
    assert mods, arch
    vocab = int(model.config.get_text_config().vocab_size)
    ps = prompts_of_lengths([5, 19, 11], vocab=vocab, seed=3)
    ids = torch.tensor([ps[1]])
    with torch.no_grad():
        before = model(ids).logits
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=16, page_size=8, max_batch_tokens=16, mla_latent_cache=True
    )  # chunked prefill
    with acb.Engine(model, cfg) as eng:
        runner = eng.runner
        cache = runner.kv_cache
        spec = cache.spec
        layers = [cache.layer_of(i) for i in sorted(mods)]
        assert spec.latent_layers == tuple(layers)
        widths = [m.kv_lora_rank + m.qk_rope_head_dim for _, m in sorted(mods.items())]
        assert [tuple(cache.k[c].shape) for c in layers] == [(16, 8, 1, w) for w in widths]
        assert all(cache.v[c].numel() == 0 for c in layers)
        assert spec.bytes_per_token()["latent"] == sum(widths) * 4
        assert spec.bytes_per_block(8) == sum(t.nbytes for t in cache.k + cache.v) // 16
        assert runner.cfg.attn_backend in ("torch", "cpu") and not runner.cfg.cuda_graphs
        # every family's expand_kv is the one B3 assumes (the probe at start)
        assert [getattr(m, latent.LATENT_ATTR).absorbs for _, m in sorted(mods.items())] == [absorb] * len(mods)
        got = [
            o.generated_tokens
            for o in eng.generate_batch(ps, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False).values()
        ]
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)
    assert all("expand_kv" not in vars(m) for m in mods.values())  # the model's own again
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert got == [reference_generate(model, p, MAX_NEW, ignore_eos=True) for p in ps]


def test_deepseek_v3_shaped_bytes_per_token():
    """A DeepSeek-V3-shaped attention (16 heads, nope 128 + rope 64, values 128, latent 512 + 64):
    the latent costs 576 values per token and layer, 10.7x less than the expanded heads
    (2 * 16 * 192 values, keys and values at the wider width)."""
    config = ms.tiny_config("deepseek_v3")
    config.update(
        dict(
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            head_dim=64,
        )
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    layers = config.num_hidden_layers
    latent = kv_spec_of(model, torch.float32, latent=True).bytes_per_token()
    expanded = kv_spec_of(model, torch.float32).bytes_per_token()
    assert latent == {"latent": layers * 576 * 4}
    assert sum(expanded.values()) == layers * 2 * 16 * 192 * 4


def test_which_backends_page_the_latent():
    """``mla_latent_cache=True`` pages the latent on the torch and Triton backends (the Triton
    backend's latent kernel: ``tests/runner/test_triton_latent.py``); Triton without it (the default
    on CUDA) keeps the expanded heads, as does ``False``; on CPU the default pages it."""
    from acb.runner.setup import resolve_config

    model = model_of("deepseek_v3")
    resolved, spec = resolve_config(
        model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8, attn_backend="triton", mla_latent_cache=True)
    )
    assert resolved.attn_backend == "triton" and spec.latent_layers == (0, 1)
    resolved, spec = resolve_config(
        model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8, attn_backend="triton")
    )
    assert resolved.attn_backend == "triton"
    assert spec.latent_layers == () and "latent" not in spec.bytes_per_token()
    resolved, spec = resolve_config(
        model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8, attn_backend="torch", mla_latent_cache=True)
    )
    assert spec.latent_layers == (0, 1)
    resolved, spec = resolve_config(model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8))
    assert spec.latent_layers == (0, 1) and resolved.attn_backend in ("torch", "cpu")  # on by default
    _, spec = resolve_config(model, acb.ContinuousBatchingConfig(num_blocks=16, page_size=8, mla_latent_cache=False))
    assert spec.latent_layers == ()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_the_latent_holds_under_prefix_reuse_samples_preemption_offload_and_sleep(arch):
    """A prefix sent once, then extended with ``n = 2`` on an engine small enough to preempt (the
    latent pages offloaded and back), then after ``sleep()``/``wake_up()``: ``model.generate``'s
    tokens, the prefix read from the cache."""
    model = model_of(arch)
    vocab = int(model.config.get_text_config().vocab_size)
    prefix = prompts_of_lengths([40], vocab=vocab, seed=17)[0]
    prompts = [prefix + t for t in prompts_of_lengths([4, 11, 6, 9], vocab=vocab, seed=18)]
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=16, page_size=8, safety_margin=0.0, cpu_offload_space=0.01, mla_latent_cache=True
    )
    refs = [reference_generate(model, p, 24, ignore_eos=True) for p in prompts]
    with acb.Engine(model, cfg) as eng:
        assert eng.runner.kv_cache.spec.latent_layers
        eng.generate(prefix, max_new_tokens=1, ignore_eos=True)
        outs = list(eng.generate_batch(prompts, max_new_tokens=24, ignore_eos=True, n=2, progress_bar=False).values())
        assert [[s.generated_tokens for s in o.samples] for o in outs] == [[r, r] for r in refs]
        assert [o.num_cached_tokens for o in outs] == [40] * len(prompts)
        assert eng.stats.preemptions > 0 and eng.stats.swapped_out_blocks > 0, eng.stats
        eng.sleep()
        eng.wake_up()
        assert eng.generate(prompts[0], max_new_tokens=24, ignore_eos=True).generated_tokens == refs[0]
