"""Prefix reuse for every layer kind, exact against ``model.generate``.

A request whose prompt is exactly a prefix of whole blocks (``max_new_tokens=1``), or that prefix
and a few tokens more, then three requests that extend the prefix: the three read the prefix from
the cache where the kind is cached (they report ``num_cached_tokens``), and give
``model.generate``'s tokens either way. One family per kind of layer acb knows: full attention,
sliding windows with soft-capping, per-layer page shapes (Gemma 4), the MLA latent (DeepSeek V3),
indexed sparse attention's key-only index pages (DeepSeek V3.2, GLM-5 DSA with a shared indexer),
linear-attention states beside attention (Qwen3-Next), pure state-space layers (Mamba2), attention
on the model's own cache (GPT-J), DeepSeek V4's own-cache layers. Tiny configs are the catalogue
sweep's (every layer kind kept). The kinds acb does not reuse yet keep prefix caching off and say
so (``num_cached_tokens`` 0): issue 53 is to reuse them too. State layers are reused through
snapshots of their state kept with the cached blocks (``acb.core.kv_manager``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import acb
from tests.conftest import assert_scores_match_forward, prompts_of_lengths, reference_generate
from tests.test_model_sweep import ms

PAGE = 8
PREFIX = 5 * PAGE  # whole blocks
MAX_NEW = 6

# arch -> whether its prefix is reused today
KINDS = {
    "llama": True,
    "gemma2": True,
    "gemma4_text": True,
    "deepseek_v3": True,
    "deepseek_v32": True,
    "glm_moe_dsa": True,
    "qwen3_next": True,
    "mamba2": True,
    "gptj": True,  # own caches: a copy cut at the block boundary (acb.runner.own_cache_runner)
    "deepseek_v4": False,
}
# arch -> whether a preempted request's cache is offloaded (else recomputed) today
OFFLOAD = dict(KINDS)
OFFLOAD.update(gptj=False, deepseek_v4=False)  # own caches: a preempted request recomputes


@functools.cache
def model_of(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ms.tiny_config(arch), dtype=torch.float32).eval()


@pytest.mark.parametrize("first", ["exactly", "longer"])
@pytest.mark.parametrize("arch", sorted(KINDS))
def test_a_prefix_is_reused_exactly(arch, first):
    model = model_of(arch)
    vocab = int(model.config.get_text_config().vocab_size)
    prefix = prompts_of_lengths([PREFIX], vocab=vocab, seed=7)[0]
    tails = prompts_of_lengths([3, 9, 17], vocab=vocab, seed=8)
    head = prefix if first == "exactly" else prefix + tails[2][:5]
    prompts = [prefix + t for t in tails]
    # the first with exactly the prefix on the plain path; the longer one under async batching
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=64, page_size=PAGE, allow_block_sharing=True, use_async_batching=first == "longer"
    )
    with acb.Engine(model, cfg) as eng:
        # a snapshot kind takes a short prompt's own snapshot inside its prefill only from
        # SPECULATIVE_MIN_TOKENS on (tests/core/test_snapshots.py): here, whatever its length
        eng.call(lambda core: setattr(core.scheduler.kv, "speculative_min_tokens", 0)).result(timeout=60)
        eng.generate(head, max_new_tokens=1, ignore_eos=True)
        outs = list(eng.generate_batch(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, progress_bar=False).values())
    assert [o.num_cached_tokens for o in outs] == [PREFIX if KINDS[arch] else 0] * 3
    assert [o.generated_tokens for o in outs] == [
        reference_generate(model, p, MAX_NEW, ignore_eos=True) for p in prompts
    ]


@pytest.mark.parametrize("arch", sorted(KINDS))
def test_a_reused_prefix_holds_under_samples_preemption_sleep_and_scoring(arch):
    """The same prefix, on one engine small enough to preempt (offloading where the kind can be
    offloaded, recomputing where not yet): its extensions with ``n = 2``, preempted, then after
    ``sleep()``/``wake_up()`` (the cache dropped: nothing reused, still exact), then scored against
    a plain forward."""
    model = model_of(arch)
    vocab = int(model.config.get_text_config().vocab_size)
    prefix = prompts_of_lengths([PREFIX], vocab=vocab, seed=17)[0]
    tails = prompts_of_lengths([4, 11, 6, 9], vocab=vocab, seed=18)
    prompts = [prefix + t for t in tails]
    cfg = acb.ContinuousBatchingConfig(
        num_blocks=16, page_size=PAGE, allow_block_sharing=True, safety_margin=0.0, cpu_offload_space=0.01
    )
    new = 3 * PAGE  # each sample grows by three blocks: the engine must preempt
    refs = [reference_generate(model, p, new, ignore_eos=True) for p in prompts]
    with acb.Engine(model, cfg) as eng:
        eng.generate(prefix, max_new_tokens=1, ignore_eos=True)
        outs = list(eng.generate_batch(prompts, max_new_tokens=new, ignore_eos=True, n=2, progress_bar=False).values())
        assert [[s.generated_tokens for s in o.samples] for o in outs] == [[r, r] for r in refs]
        assert [o.num_cached_tokens for o in outs] == [PREFIX if KINDS[arch] else 0] * len(prompts)
        assert eng.stats.preemptions > 0, eng.stats
        # the paged kinds are offloaded; the state layers and own caches are recomputed (issue 53)
        assert (eng.stats.swapped_out_blocks > 0) == OFFLOAD[arch], eng.stats
        eng.sleep()
        eng.wake_up()
        again = eng.generate(prompts[0], max_new_tokens=new, ignore_eos=True)
        assert again.generated_tokens == refs[0] and again.num_cached_tokens == 0
        assert_scores_match_forward(eng, model, prompts[1], [tails[2][:1], tails[3][:3]])
