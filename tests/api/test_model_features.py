"""Model features beyond plain causal attention, greedy-exact against ``model.generate``:

* attention sinks (GPT-OSS: per-head learned ``sinks`` logits passed as ``s_aux``; alternating
  sliding-window layers; MoE);
* chunked attention (Llama 4 text: ``attention_chunk_size`` on its ``chunked_attention`` layers,
  no-RoPE full layers with attention temperature tuning, MoE);
* KV sharing across layers (Gemma 3n text: the last ``num_kv_shared_layers`` read an earlier
  layer's cache and have none of their own; altup, laurel, per-layer inputs).

Each on the torch backend whole, with chunked prefill, preemption, ``n > 1``, async batching and
the prefix cache, in mixed batches of very different lengths. The Triton and flash-attn backends
(kernels and the engine) are in ``tests/runner/test_attention_features.py``.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import acb
from acb.errors import UnsupportedModelError
from tests.conftest import assert_scores_match_forward, prompts_of_lengths, reference_generate

# tiny configs; windows and chunks far below the prompts' lengths, so that they matter
FEATURE_CONFIGS: dict[str, dict] = {
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # floor_scale 8: the no-RoPE layer's query temperature changes from position 7 on
    "llama4_text": dict(
        hidden_size=64,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        floor_scale=8,
        attn_scale=0.5,
    ),
    "gemma3n_text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        laurel_rank=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    ),
    # per-layer page shapes: full layers twice as wide (global_head_dim) with one KV head, keys as
    # values (attention_k_eq_v), the last two layers reading earlier ones' K/V; MoE, per-layer inputs
    "gemma4_text": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
    ),
    # per-layer page shapes: its sliding layers have twice the full layers' KV heads (and sinks);
    # keys 24 wide, values 16
    "mimo_v2_flash": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        v_head_dim=16,
        sliding_window=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
    ),
}
ARCHS = list(FEATURE_CONFIGS)
MAX_NEW = 8


def feature_model(arch: str, **overrides):
    """A tiny random ``arch`` model (eager attention: GPT-OSS has no SDPA path in transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        FEATURE_CONFIGS[arch],
        vocab_size=256,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(arch, **kw), attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


model_of = functools.lru_cache(maxsize=None)(feature_model)


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return reference_generate(model_of(arch), list(prompt), max_new)


def check(arch, prompts, outs, max_new=MAX_NEW):
    for p, o in zip(prompts, outs):
        assert o.status == acb.RequestStatus.FINISHED, o
        assert o.generated_tokens == _reference(arch, tuple(p), max_new), f"{arch}: prompt of {len(p)} tokens"


# very different lengths: one token, under a window/chunk, several chunks, many blocks
LENGTHS = [1, 5, 17, 41, 70]


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_and_chunked_prefill(arch):
    model = model_of(arch)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    for budget in (None, 8):  # whole prompts; then 8-token steps mixing decode rows and prefill chunks
        cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=budget, attn_backend="torch")
        res = acb.generate_batch(
            model, prompts, continuous_batching_config=cfg, max_new_tokens=MAX_NEW, progress_bar=False
        )
        check(arch, prompts, res.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption(arch):
    model = model_of(arch)
    prompts = prompts_of_lengths([20, 31, 12, 25, 9, 17], seed=4)
    # 12 usable blocks of 4 tokens for 6 requests of ~30 tokens: preemption must happen
    cfg = acb.ContinuousBatchingConfig(page_size=4, num_blocks=13, safety_margin=0.0, attn_backend="torch")
    with acb.Engine(model, cfg) as engine:
        outs = [
            h.result(timeout=120)
            for h in [engine.submit(p, acb.SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        ]
        assert engine.stats.preemptions > 0
    check(arch, prompts, outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_n_samples_async_batching_and_prefix_cache(arch):
    model = model_of(arch)
    prompts = prompts_of_lengths([33, 6, 52], seed=7)
    cfg = acb.ContinuousBatchingConfig(
        page_size=8, num_blocks=64, use_async_batching=True, max_batch_tokens=24, attn_backend="torch"
    )
    with acb.Engine(model, cfg) as engine:
        assert engine.runner.cfg.async_batching
        first = [
            h.result(timeout=120)
            for h in [engine.submit(p, acb.SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        ]
        # the same prompts again: their full blocks come from the prefix cache
        again = [
            h.result(timeout=120)
            for h in [engine.submit(p, acb.SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        ]
        assert sum(o.num_cached_tokens for o in again) >= 32 + 48
        many = engine.generate(prompts[0], acb.SamplingParams(n=3, max_new_tokens=MAX_NEW))
    check(arch, prompts, first)
    check(arch, prompts, again)
    assert len(many.samples) == 3
    for s in many.samples:
        assert s.generated_tokens == _reference(arch, tuple(prompts[0]), MAX_NEW)


def test_gemma3n_shared_layers_have_no_cache():
    model = model_of("gemma3n_text")
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16, attn_backend="torch")) as eng:
        cache = eng.runner.kv_cache
        # layers 4 and 5 (sliding, full) reuse the last earlier layer of their type's K/V (layers 3 and
        # 2): 4 cache layers for 6 model layers
        assert len(cache.k) == len(cache.v) == 4
        assert cache.spec.layer_map == (0, 1, 2, 3, 3, 2)


# per-layer page shapes: (kv_heads, head_dim) of each cache layer, and its layer map
PAGE_SHAPES = {
    "gemma4_text": ([(2, 16), (2, 16), (1, 32), (2, 16)], (0, 1, 2, 3, 3, 2)),
    "mimo_v2_flash": ([(1, 24), (2, 24), (2, 24), (2, 24)], None),
}


@pytest.mark.parametrize("arch", sorted(PAGE_SHAPES))
def test_layers_of_different_shapes_are_cache_groups(arch):
    """Each cache layer's pages take its layers' own shape; the layers of one shape are a group;
    one block costs every group's pages (so the budget splits by what a token costs in each)."""
    shapes, layer_map = PAGE_SHAPES[arch]
    model = model_of(arch)
    with acb.Engine(model, acb.ContinuousBatchingConfig(page_size=8, num_blocks=16, attn_backend="torch")) as eng:
        cache = eng.runner.kv_cache
        spec = cache.spec
        assert [tuple(t.shape) for t in cache.k] == [(16, 8, *s) for s in shapes]
        assert [tuple(t.shape) for t in cache.v] == [(16, 8, *s) for s in shapes]
        assert spec.layer_map == layer_map
        groups: dict = {}
        for layer, shape in enumerate(shapes):
            groups.setdefault(shape, []).append(layer)
        assert spec.kv_shapes() == groups and len(groups) == 2
        assert spec.bytes_per_token() == {(h, d): 2 * len(ls) * h * d * 4 for (h, d), ls in groups.items()}
        assert spec.bytes_per_block(8) == sum(t.nbytes for t in cache.k + cache.v) // 16
        assert cache.flat_k(2).shape == (16 * 8, *shapes[2])


@pytest.mark.parametrize("arch", sorted(PAGE_SHAPES))
def test_per_layer_shapes_score_offload_cancel_and_sleep(arch):
    """The rest of the modes on a model of several page shapes: offload under preemption (every
    layer's own page shape copied out and back), scoring equal to a plain forward's log-softmax,
    sleep / wake (the cache reallocated per layer), and a request cancelled mid-prefill."""
    model = model_of(arch)
    prompts = prompts_of_lengths([20, 31, 12, 25, 9, 17], seed=4)
    cfg = acb.ContinuousBatchingConfig(
        page_size=4, num_blocks=13, safety_margin=0.0, cpu_offload_space=0.01, attn_backend="torch"
    )
    with acb.Engine(model, cfg) as engine:
        outs = [
            h.result(timeout=120)
            for h in [engine.submit(p, acb.SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
        ]
        stats = engine.stats
        assert stats.preemptions > 0 and stats.swapped_out_blocks > 0 and stats.swapped_in_blocks > 0, stats
        check(arch, prompts, outs)
        # scoring: each continuation's logprobs are a plain forward's log-softmax
        context, conts = prompts[1][:12], [prompts[0][:3], prompts[2][:1]]
        assert_scores_match_forward(engine, model, context, conts)
        engine.sleep()
        engine.wake_up()
        assert [tuple(t.shape[2:]) for t in engine.runner.kv_cache.k] == PAGE_SHAPES[arch][0]
        again = engine.generate(prompts[3], acb.SamplingParams(max_new_tokens=MAX_NEW))
        assert again.generated_tokens == _reference(arch, tuple(prompts[3]), MAX_NEW)
    # cancelled mid-prefill: a 100-token prompt in 4-token chunks, cancelled once some are computed
    cfg = acb.ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=4, attn_backend="torch")
    with acb.Engine(model, cfg) as engine:
        long = prompts_of_lengths([100], seed=9)[0]
        h = engine.submit(long, acb.SamplingParams(max_new_tokens=MAX_NEW))

        def computed(core) -> int:  # (on the engine thread, between two steps)
            return next((r.num_computed_tokens for r in core.scheduler.running if r.request_id == h.request_id), 0)

        while not 0 < engine.call(computed).result(timeout=120) < len(long):
            pass
        h.cancel()
        out = h.result(timeout=120)
        assert out.status == acb.RequestStatus.CANCELLED and out.generated_tokens == []
        after = engine.generate(long[:30], acb.SamplingParams(max_new_tokens=MAX_NEW))  # nothing left behind
        assert after.generated_tokens == _reference(arch, tuple(long[:30]), MAX_NEW)


# Gemma 4's conditional model (a vision tower beside the text model) on a 26B-A4B-style text config:
# K=V full layers with one global KV head, an MoE block in every layer, no KV sharing and no per-layer
# inputs. Its vision tower's attention layers are numbered from 0 too: the cache must be sized from
# the text model's layers only (they were taken for layers 0 and 1, and every request failed).
GEMMA4_26B_A4B_TEXT = dict(
    FEATURE_CONFIGS["gemma4_text"],
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    vocab_size=256,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


@functools.cache
def gemma4_conditional():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = Gemma4Config(
        text_config=GEMMA4_26B_A4B_TEXT,
        vision_config=vision,
        audio_config=None,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(config).eval()


def test_gemma4_conditional_model_is_sized_by_its_text_model():
    """The conditional model's cache takes its text layers' shapes (a 26B-A4B-style text config:
    (2, 16) sliding, (1, 32) K=V full), whatever its vision tower's attention looks like; greedy
    equals ``model.generate`` on the conditional model, in a batch of prefill chunks and decode rows."""
    model = gemma4_conditional()
    prompts = prompts_of_lengths([1, 17, 41], seed=1)
    want = [reference_generate(model, p, MAX_NEW) for p in prompts]
    assert len({tuple(w) for w in want}) > 1  # (the tokens depend on the prompt)
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=16)
    with acb.Engine(model, cfg) as eng:
        assert [tuple(t.shape[2:]) for t in eng.runner.kv_cache.k] == [(2, 16), (2, 16), (1, 32)] * 2
        outs = eng.generate_batch(prompts, max_new_tokens=MAX_NEW, progress_bar=False)
    assert [o.generated_tokens for o in outs.values()] == want


# --- refused at start, with the feature named ------------------------------------------------------------


def _refused(model, match, own_runs=True):
    """The paged path refuses it, naming why; with no runner asked for, the engine starts on the
    model's own cache instead (``own_runs``), or, for a model broken for its own code too, refuses
    with both reasons."""
    with pytest.raises(UnsupportedModelError, match=match):
        acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=8, runner="paged")).start()
    if own_runs:
        with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=8)) as eng:
            assert eng.runner.own_cache_runner is not None
        return
    with pytest.raises(UnsupportedModelError, match=f"paged path refuses it .*{match}.*its own forward failed"):
        acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=8)).start()


def test_chunk_size_without_chunked_layers_is_refused():
    model = feature_model(
        "llama4_text", num_hidden_layers=2, layer_types=["full_attention", "full_attention"], no_rope_layers=[1, 1]
    )
    model.config.attention_chunk_size = 8  # set after the config's own checks, as a foreign config might
    _refused(model, "attention_chunk_size")


def test_unknown_kv_sharing_is_refused():
    model = feature_model("gemma3n_text")
    model.model.layers[5].self_attn.is_kv_shared_layer = False  # the modules disagree with the config
    _refused(model, "reuses another layer's K/V", own_runs=False)  # (its own code breaks on the change too)


def test_unknown_layer_type_is_refused():
    model = feature_model("gpt_oss")
    model.config.layer_types = ["sliding_attention", "mystery_attention"]
    _refused(model, "mystery_attention", own_runs=False)


# --- the tiny configs keep the real configs' field types ------------------------------------------
# Every family a test runs: acb.models' tiny ones, the feature configs above, and the hybrid,
# latent-attention and other families acb claims (tests/test_model_sweep.py's CLAIMED).
def _claimed() -> tuple[str, ...]:
    from tests.test_model_sweep import CLAIMED

    return CLAIMED


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _type_mismatches(arch: str, tiny) -> list[str]:
    """Fields whose type in ``tiny`` is not the real config's (a per-layer list that became an int,
    or the reverse), and per-layer lists not as long as the tiny model's layer count."""
    from transformers import AutoConfig

    real, small = AutoConfig.for_model(arch).to_dict(), tiny.to_dict()
    layers, tiny_layers = real.get("num_hidden_layers"), small.get("num_hidden_layers")
    bad = []
    for key, value in real.items():
        got = small.get(key)
        if value is None or got is None:
            continue
        if _kind(value) != _kind(got):
            bad.append(f"{arch}.{key}: {_kind(got)} {got!r:.40}, the real config's is {_kind(value)} {value!r:.40}")
        elif (
            isinstance(value, list)
            and len(value) == layers
            and not key.endswith(("_layers", "_idxs", "_indices"))
            and len(got) != tiny_layers
        ):
            bad.append(f"{arch}.{key}: a per-layer list of {len(got)} for {tiny_layers} layers")
    return bad


@pytest.mark.parametrize("arch", sorted({*acb.models.TINY_ARCHS, *FEATURE_CONFIGS}))
def test_tiny_configs_keep_the_real_field_types(arch):
    """A tiny config proves something about the real one only if each field keeps its type (a
    per-layer list stays a list, as long as the layers): checked for every tiny config the tests
    build, against the config class's defaults."""
    from transformers import AutoConfig

    if arch in FEATURE_CONFIGS:
        tiny = AutoConfig.for_model(arch, **dict(FEATURE_CONFIGS[arch], vocab_size=256))
    else:
        tiny = acb.models.tiny_config(arch)
    assert not _type_mismatches(arch, tiny)


def test_the_type_check_sees_a_list_made_an_int():
    """The check above can fail: Gemma 3n's per-layer intermediate_size given as one int in the dict
    (as a config built by hand, not through the class, would hold it)."""
    from transformers import AutoConfig

    tiny = AutoConfig.for_model("gemma3n_text", **dict(FEATURE_CONFIGS["gemma3n_text"], vocab_size=256))
    tiny.intermediate_size = 128
    assert any("intermediate_size" in m for m in _type_mismatches("gemma3n_text", tiny))


@pytest.mark.parametrize("async_batching", [False, True])
@pytest.mark.parametrize("arch", _claimed())
def test_each_family_from_its_real_defaults_starts_sized_and_exact(arch, async_batching):
    """Each family acb claims, built from its config class's defaults shrunk the catalogue sweep's
    way (``benchmarks/model_sweep.py``: sizes cut, per-layer lists kept as lists, cut to the kept
    layers; Gemma 3n's intermediate_size stays a list of one width per layer), started **without**
    ``num_blocks`` (so the engine sizes its cache and step workspace from the config, which read a
    per-layer list as an int before) and exact against ``model.generate``, chunked prefill too."""
    from transformers import AutoModelForCausalLM

    from tests.test_model_sweep import ms

    cfg = ms.tiny_config(arch)
    assert not _type_mismatches(arch, cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    vocab = cfg.get_text_config().vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(ms.FIRST_PROMPT_ID, vocab, (n,), generator=g).tolist() for n in (1, 7, 30)]
    refs = [reference_generate(model, p, 6) for p in prompts]
    config = acb.ContinuousBatchingConfig(
        max_requests_per_batch=4, max_batch_tokens=16, use_async_batching=async_batching
    )
    with acb.Engine(model, config) as eng:
        assert eng.config.num_blocks > 0
        outs = eng.generate_batch(prompts, max_new_tokens=6, do_sample=False, progress_bar=False)
    assert [o.generated_tokens for o in outs.values()] == refs


def test_a_model_without_attention_skips_the_attention_check(caplog):
    """Pure Mamba2 has no attention layer: the automatic backend's start-up check (which reads head
    counts such a config does not have) is skipped, silently, and the model stays exact."""
    from tests.api.test_state_layers import model_of as state_model
    from tests.api.test_state_layers import prompts, reference

    ps = prompts([5, 17, 9], arch="mamba2")
    with caplog.at_level(logging.WARNING, logger="acb"):
        with acb.Engine(state_model("mamba2"), acb.ContinuousBatchingConfig(num_blocks=32, page_size=8)) as eng:
            assert eng.runner.kv_cache.spec.kv_shapes() == {}
            outs = eng.generate_batch(ps, max_new_tokens=6, ignore_eos=True, progress_bar=False)
    assert not [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
    assert [o.generated_tokens for o in outs.values()] == [reference("mamba2", tuple(p)) for p in ps]


def test_prompt_ids_may_reach_past_the_output_vocabulary():
    """Prompt ids are checked against the input embeddings (Molmo2's image tokens lie past its
    output vocabulary): an id the embeddings hold runs exactly; one past them is refused; what is
    sampled, scored or biased stays within the output vocabulary."""
    from acb.models import tiny_model

    model = tiny_model("llama", tie_word_embeddings=False)
    vocab = model.config.vocab_size
    torch.manual_seed(3)
    model.model.embed_tokens = torch.nn.Embedding(vocab + 8, model.config.hidden_size)
    prompt = [5, vocab + 3, 9, vocab + 7, 11]
    with acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=32, page_size=8)) as eng:
        out = eng.generate(prompt, max_new_tokens=6, ignore_eos=True)
        assert out.generated_tokens == reference_generate(model, prompt, 6, ignore_eos=True)
        with pytest.raises(acb.InvalidRequestError, match=rf"prompt_ids\[1\] = {vocab + 8} is outside"):
            eng.generate([5, vocab + 8], max_new_tokens=1)
        with pytest.raises(acb.InvalidRequestError, match="continuation token id"):
            eng.score(prompt, [[vocab + 3]])
        scored = eng.score(prompt, [[4]])  # a context with those ids is scored as a forward gives it
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)[4].item()
    assert scored.continuations[0].logprobs[0] == pytest.approx(expected, abs=1e-5)
