"""Hybrid linear-attention models (issue 30): Qwen3-Next (gated delta rule + attention, MoE) and
Qwen3.5 (dense and MoE text models), greedy token for token against ``model.generate``, whole,
with chunked prefill, with preemption (recompute) under a tiny KV cache, n > 1 (the samples
fork from the prompt's recurrent state), async batching, and requests of very different lengths
joining a running batch (a state indexed by batch position instead of request would leak)."""

from __future__ import annotations

import pytest
import torch

import acb
from tests.conftest import reference_generate

LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    layer_types=LAYERS,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _config(kind: str):
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(**COMMON, **MOE)
    elif kind == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**COMMON)
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(**COMMON, **MOE)
    return cfg


def _build(kind: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(kind)).eval()


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_the_tiny_hybrid_configs_keep_the_real_field_types(kind):
    """These hand-built configs keep each field's type and every layer kind of the real ones (the
    per-layer ``layer_types`` a list as long as the layers, linear and full attention both)."""
    from tests.api.test_model_features import _type_mismatches

    cfg = _config(kind)
    assert not _type_mismatches(cfg.model_type, cfg)
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}


_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def hybrid(request):
    if request.param not in _MODELS:
        try:
            _MODELS[request.param] = _build(request.param)
        except (ImportError, AttributeError) as exc:  # (an older transformers)
            pytest.skip(f"{request.param} is not in this transformers: {exc}")
    return _MODELS[request.param]


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),
        dict(max_batch_tokens=8),  # chunked prefill: the state carries from chunk to chunk
        dict(use_async_batching=True),
        dict(num_blocks=16, page_size=4, max_batch_tokens=16),  # preemption: recomputed from no state
        # offload: the KV blocks and the row of state go to host memory and come back
        dict(num_blocks=16, page_size=4, max_batch_tokens=16, cpu_offload_space=0.01, use_async_batching=True),
    ],
    ids=["whole", "chunked", "async", "preempt", "offload-async"],
)
def test_greedy_parity(hybrid, cfg):
    prompts = _prompts([5, 17, 30, 9])
    refs = [reference_generate(hybrid, p, 8) for p in prompts]
    with acb.Engine(hybrid, acb.ContinuousBatchingConfig(**{"num_blocks": 64, "page_size": 8, **cfg})) as eng:
        # prefix caching (a hit restores a snapshot of the state), and offload where asked for
        assert eng.config.prefix_caching and (eng.config.num_swap_blocks > 0) is ("cpu_offload_space" in cfg)
        res = eng.generate_batch(prompts, max_new_tokens=8, ignore_eos=True, progress_bar=False)
        assert [o.generated_tokens for o in res.values()] == refs
        if "num_blocks" in cfg:
            assert eng.stats.preemptions > 0
        if "cpu_offload_space" in cfg:  # resumed from host memory, not recomputed
            assert eng.stats.swapped_out_rows > 0 and eng.stats.recomputed_preemptions == 0, eng.stats


def test_samples_fork_the_state_and_late_joiners_do_not_leak(hybrid):
    """n=3 greedy samples all equal the reference (each forked from the prompt's state); then
    requests of very different lengths join a batch already running, one per step, in an order
    that puts them at other batch positions than their rows."""
    prompts = _prompts([3, 41, 12, 26, 7], seed=2)
    refs = [reference_generate(hybrid, p, 10) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(num_blocks=64, page_size=4, max_batch_tokens=12, use_async_batching=True)
    with acb.Engine(hybrid, cfg) as eng:
        out = eng.generate(prompts[1], max_new_tokens=10, ignore_eos=True, n=3)
        assert [s.generated_tokens for s in out.samples] == [refs[1]] * 3
        handles = []
        for p in reversed(prompts):  # the longest ones join while the others decode
            handles.append(eng.submit(p, max_new_tokens=10, ignore_eos=True))
            eng.core.call(lambda c: None).result(timeout=30)  # one engine loop iteration between joins
        got = [h.result(timeout=60).generated_tokens for h in handles]
    assert got == list(reversed(refs))


def test_a_users_own_forward_is_untouched_while_the_engine_runs(hybrid):
    """The layers are intercepted only inside engine steps: the model's own forward (a trainer's)
    gives the same logits with the engine running."""
    p = torch.tensor([_prompts([11], seed=3)[0]])
    with torch.no_grad():
        before = hybrid(p).logits
    with acb.Engine(hybrid, acb.ContinuousBatchingConfig(num_blocks=32)) as eng:
        eng.generate(p[0].tolist(), max_new_tokens=3)
        with torch.no_grad():
            during = hybrid(p).logits
    assert torch.equal(before, during)


def test_sleep_and_wake_mid_run(hybrid):
    """sleep() takes the running requests off the device and drops their states; after
    wake_up() they are recomputed from no state, and the outputs are still the reference."""
    prompts = _prompts([6, 19], seed=4)
    refs = [reference_generate(hybrid, p, 12) for p in prompts]
    with acb.Engine(hybrid, acb.ContinuousBatchingConfig(num_blocks=32, page_size=4)) as eng:
        hs = [eng.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        while not all(r.num_generated for r in list(eng.core.scheduler.running)) or len(eng.core.scheduler.running) < 2:
            eng.core.call(lambda c: None).result(timeout=30)
        eng.sleep()
        assert eng.runner.states.nbytes() == 0  # the states were dropped with the cache
        eng.wake_up()
        assert [h.result(timeout=60).generated_tokens for h in hs] == refs
