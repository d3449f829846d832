"""The batch-invariant mode on indexed sparse attention (acb.runner.batch_invariant_dsa): DeepSeek
V3.2, GLM-5 (a "shared" indexer layer), AXK2 and Hunyuan V4 (sinks, a gated output) give a request
the same tokens and logprob bits alone, among 23 others, chunked, with async batching and
preemption, after a prefix hit; and a trainer's forward under ``enabled(model)`` (whole sequences,
left-padded, the model's own DSA code) computes exactly the engine's logprobs. The off switches
show what each fixed form holds: the selected keys' attention through masked SDPA moves a chunked
request's bits; the indexer's own top-k moves its selection where the scores tie."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import acb
from acb.runner import batch_invariant as bi
from acb.runner import batch_invariant_dsa as dsa
from acb.runner import batch_invariant_scope as scope
from acb.runner.indexed import indexer_modules
from tests.runner import test_batch_invariant
from tests.runner.test_batch_invariant import TEMP, bits, same, together

SP = replace(test_batch_invariant.SP, max_new_tokens=8)  # seeded sampling at TEMP, processed logprobs


def _family(model_type, seed=0):
    from transformers import AutoModelForCausalLM

    from acb.bench.families import tiny_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


def _prompts(model, seed=0, n=23):
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    target = [rng.randrange(3, vocab) for _ in range(70)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]
    return target, others


def _run(model, prompts, stats=False, **cfg):
    cfg.setdefault("num_blocks", 200)
    config = acb.ContinuousBatchingConfig(page_size=16, batch_invariant=True, cpu_threads=2, **cfg)
    with acb.Engine(model, config) as eng:
        got = together(eng, prompts, SP)
        st = eng.stats
    got = got
    return (got, st) if stats else got


def _trainer_matches(model, target, alone, short, short_alone):
    """The trainer's forward over both sequences at once (the shorter left-padded), under
    ``enabled(model)``: each completion token's logprob is exactly the engine's."""
    seqs = [target + alone[0], short + short_alone[0]]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with bi.enabled(model), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for row, (p, (t, want)) in enumerate([(target, alone), (short, short_alone)]):
        start = width - len(p) - len(t)
        got = bi.token_logprobs(logits[row, start + len(p) - 1 : width - 1], t, TEMP).double()
        if not torch.equal(got, want):
            return False
    return True


@pytest.fixture(scope="module")
def v32():
    return _family("deepseek_v32")


@pytest.fixture(scope="module")
def v32_alone(v32):
    target, others = _prompts(v32)
    return _run(v32, [target, others[3]])  # (two requests of a batch alone: each its own rows)


def test_deepseek_v32_alone_equals_in_a_batch_chunked_async_and_preempted(v32, v32_alone):
    target, others = _prompts(v32)
    alone = v32_alone[0]
    assert same(_run(v32, [target])[0], alone)
    # among 23 others over 128-token steps (the target's prefill cut where the others put the edge)
    assert same(_run(v32, [*others, target], max_batch_tokens=128)[-1], alone)
    # chunked at 24 tokens, async scheduling, a cache too small for every row (preemption)
    outs, stats = _run(
        v32,
        [*others[:6], target],
        stats=True,
        max_batch_tokens=24,
        use_async_batching=True,
        num_blocks=7,
        cpu_offload_space=0.01,
    )
    assert same(outs[-1], alone)
    assert stats.preemptions > 0 and stats.swapped_out_blocks > 0  # (preempted rows offloaded)


def test_deepseek_v32_after_a_prefix_hit(v32, v32_alone):
    """48 tokens cached, the rest prefilled beside four other requests in 24-token steps."""
    target, others = _prompts(v32)
    alone = v32_alone[0]
    config = acb.ContinuousBatchingConfig(
        page_size=16, num_blocks=200, batch_invariant=True, cpu_threads=2, max_batch_tokens=24
    )
    with acb.Engine(v32, config) as eng:
        eng.generate(target[:48] + [5, 6], acb.SamplingParams(max_new_tokens=1))
        eng.pause()
        handles = [eng.submit(p, SP) for p in [target, *others[4:8]]]
        eng.resume()
        out = handles[0].result()
        assert eng.stats.prefix_hits >= 48 and out.num_cached_tokens == 48
    assert same(bits(out), alone)


def test_deepseek_v32_trainers_forward_computes_the_engines_logprobs_exactly(v32, v32_alone):
    target, others = _prompts(v32)
    assert _trainer_matches(v32, target, v32_alone[0], others[3], v32_alone[1])
    # the backward runs through the fixed forms; its gradients are the plain forward's to rounding
    ids = torch.tensor([target + v32_alone[0][0]])
    v32.zero_grad()
    with bi.enabled(v32):
        v32(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    got = {n: p.grad.clone() for n, p in v32.named_parameters() if p.grad is not None}
    v32.zero_grad()
    v32(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    assert any("q_b_proj" in n for n in got)
    assert all(torch.allclose(got[n], p.grad, rtol=1e-3, atol=1e-5) for n, p in v32.named_parameters() if n in got)
    v32.zero_grad()


def test_without_the_fixed_attention_a_chunked_request_moves(v32, v32_alone, monkeypatch):
    """The off switch: the selected keys through the torch backend's masked SDPA (blocked sums
    shaped by the chunk) give the chunked request other bits, and the trainer's forward others."""
    target, others = _prompts(v32)
    monkeypatch.setattr(dsa, "FIXED_ATTENTION", False)
    alone = _run(v32, [target])[0]
    assert not same(_run(v32, [target], max_batch_tokens=24)[0], alone)
    assert not _trainer_matches(v32, target, alone, others[3], v32_alone[1])


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "axk2", "hy_v4"])
def test_dsa_families_alone_equal_in_a_batch_chunked_and_the_trainer(arch):
    """GLM-5 (its second layer reuses the first's selection), AXK2, Hunyuan V4 (attention sinks,
    a sigmoid-gated output; its third layer shares)."""
    model = _family(arch)
    target, others = _prompts(model, seed=1, n=23)
    alone, short = _run(model, [target, others[0]])
    assert same(_run(model, [*others, target], max_batch_tokens=128)[-1], alone)
    assert same(_run(model, [target], max_batch_tokens=24, use_async_batching=True)[0], alone)
    assert _trainer_matches(model, target, alone, others[0], short)


def test_tied_scores_select_the_same_keys_alone_chunked_and_in_the_trainer(monkeypatch):
    """Indexer keys of zeros (every score ties at exactly 0: the ReLU's common case, every key at
    once): the selection is the tie-breaking alone. The fixed top-k (a stable sort) picks the same
    keys however the prompt is chunked and in the trainer's forward; the indexer's own ``topk``
    (the off switch) picks by the row's width, and the bits move."""
    from acb.runner.indexed import indexer_modules

    model = _family("deepseek_v32", seed=2)
    for m in indexer_modules(model):
        m.wk.weight.data.zero_()
    target, others = _prompts(model, seed=2, n=1)
    alone, short = _run(model, [target, others[0]])
    assert same(_run(model, [target], max_batch_tokens=24)[0], alone)
    assert _trainer_matches(model, target, alone, others[0], short)
    monkeypatch.setattr(dsa, "FIXED_INDEXER", False)
    off = _run(model, [target])[0]
    assert not same(_run(model, [target], max_batch_tokens=24)[0], off)


def test_the_fixed_products_give_a_score_the_same_bits_in_any_call():
    """The indexer's two products in their fixed form: a query's scores against a key are the same
    bits whatever other queries and keys share the call; the top-k breaks ties to the earlier key
    whatever the row's width past them."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 40, 16, 32, generator=g)  # [B, S, H, D]
    k = torch.randn(1, 1, 32, 90, generator=g)  # [B, 1, D, T]
    whole = dsa.fixed_matmul(q, k)
    assert all(
        torch.equal(dsa.fixed_matmul(q[:, s : s + 1], k[..., : 50 + s])[0, 0], whole[0, s, :, : 50 + s])
        for s in range(40)
    )
    assert torch.allclose(whole, torch.matmul(q, k), rtol=1e-5, atol=1e-5)
    row = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, float("-inf"), float("-inf")]])
    for width in (5, 6, 8):
        assert dsa.fixed_topk(row[:, :width], 4).indices.tolist() == [[1, 4, 0, 2]]
    # the heads' weighted sum, a query alone over its own keys against all 40 over 90
    w = torch.randn(1, 40, 1, 16, generator=g)
    scores = whole.relu()

    def moved(matmul):
        full = matmul(w, scores)
        return sum(
            not torch.equal(matmul(w[:, s : s + 1], scores[:, s : s + 1, :, : 50 + s])[0, 0], full[0, s, :, : 50 + s])
            for s in range(40)
        )

    assert moved(dsa.fixed_matmul) == 0
    if moved(torch.matmul) == 0:
        pytest.skip("torch.matmul gives these rows the same bits here too (nothing to show)")


def test_the_trainers_forward_on_a_model_an_engine_holds(v32, v32_alone):
    """A trainer's forward on the very model a running engine holds (its attention is the engine's,
    which outside a step calls the mode's with the selection, not a mask folded from it)."""
    target, _ = _prompts(v32)
    tokens, lps = v32_alone[0]
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=200, batch_invariant=True, cpu_threads=2)
    with acb.Engine(v32, config) as eng:
        out = eng.submit(target, SP).result()
        with bi.enabled(v32), torch.no_grad():
            logits = v32(torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
    assert out.generated_tokens == tokens
    assert torch.equal(bi.token_logprobs(logits, tokens, TEMP).double(), lps)


def test_what_stays_refused(monkeypatch):
    """The selection's fixed forms are float32 CPU: DSA with the Triton kernels, or a model on another
    device, is refused with the reason; on CPU nothing is."""
    model = _family("deepseek_v32")
    assert dsa.dsa_refusal(model, indexer_modules(model)) is None
    monkeypatch.setattr(bi, "KERNEL", True)
    assert "take no selection" in scope.refusal(model, acb.ContinuousBatchingConfig(batch_invariant=True))
    monkeypatch.setattr(bi, "KERNEL", False)
    assert "on meta" in dsa.dsa_refusal(model.to("meta"), indexer_modules(model))
