"""The batch-invariant mode on the second runner path (models on their own cache objects,
acb.runner.batch_invariant_own): a request's tokens and logprobs are the same bits alone, among 16
others of other lengths, at a small step budget, and with async batching in a cache small enough to
preempt; and a trainer's forward over the whole sequence under ``enabled(model)`` computes exactly
the engine's logprobs. The rows run in the path's batched forms (left-padded prefill groups,
stacked decode rows) where the start-up try proves them exact, else one row a call (a model whose
code mixes rows falls back, still exact). A model whose attention is its own code runs its
products by the mode's fixed forms (GPT-J); one whose code computes other products, or whose one-
token form differs from its whole-sequence forward, is refused with the reason."""

from __future__ import annotations

import random

import pytest
import torch

import acb
from acb.runner import batch_invariant as bi
from tests.runner.test_batch_invariant import TEMP, same, together


def _family(model_type):
    from transformers import AutoModelForCausalLM

    from acb.bench.families import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()


def _prompts(vocab, n=16):
    rng = random.Random(0)
    target = [rng.randrange(16, vocab) for _ in range(37)]
    others = [[rng.randrange(16, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]
    return target, others


def _run(model, prompts, form=None, **cfg):
    """Every prompt submitted while the engine is paused (they enter its first step together);
    each output's (tokens, logprobs), and the engine's stats. ``form``: the rows' form the runner
    must have chosen (``mode_rows``: "batched" or "alone")."""
    cfg.setdefault("num_blocks", 200)
    config = acb.ContinuousBatchingConfig(page_size=8, batch_invariant=True, cpu_threads=1, **cfg)
    with acb.Engine(model, config) as eng:
        own = eng.runner.own_cache_runner
        assert own is not None  # the second runner path
        assert form is None or own.mode_rows == form, (own.mode_rows, own.mode_rows_why)
        got = together(eng, prompts)
        stats = eng.stats
    return got, stats


def _trainer_equals_engine(model, target, alone):
    tokens, lps = alone
    with bi.enabled(model), torch.no_grad():
        logits = model(input_ids=torch.tensor([target + tokens])).logits
    got = bi.token_logprobs(logits[0, len(target) - 1 : -1], tokens, TEMP).double()
    assert torch.equal(got, lps), (got - lps).abs().max()


# StableLM (a decoder-only through the attention interface) runs its rows batched (the start-up
# try proves it; so do BioGPT, DiffLlama, JetMoe); BART's decoder (learned positions counted from its
# cache) and RWKV (a recurrent state, no attention) take no position ids: one row a call
# (GPT-J, Falcon: their attention is their own code, its products and Falcon's own SDPA call by
# acb.runner.batch_invariant_products)
@pytest.mark.parametrize(
    "arch, form",
    [("stablelm", "batched"), ("bart", "alone"), ("rwkv", "alone"), ("gptj", "batched"), ("falcon", "alone")],
)
def test_alone_equals_in_a_batch_preempted_async_and_the_trainer(arch, form):
    model = _family(arch)
    target, others = _prompts(model.config.get_text_config().vocab_size)
    (alone,), _ = _run(model, [target], form)
    outs, _ = _run(model, [*others, target], form)
    assert same(outs[-1], alone)
    # a small step budget, async scheduling, a cache too small for every row (preemptions: a
    # recompute replays the prompt, then a token a call)
    outs, stats = _run(model, [target, *others], form, max_batch_tokens=16, use_async_batching=True, num_blocks=8)
    assert stats.preemptions > 0
    assert same(outs[0], alone)
    _trainer_equals_engine(model, target, alone)
    assert model.config._attn_implementation != bi.ATTN_IMPL_NAME  # its own attention back between steps


def test_rows_that_mix_run_one_a_call_still_exact(monkeypatch):
    """A model whose code mixes a batch's rows (a hook adding a little of the batch's mean: one
    row alone is unchanged by it, so the refusal's checks pass) fails the start-up try of the
    batched forms and runs one row a call, exact; with the try skipped it would run batched, and a
    request among others would change."""
    from acb.runner import batch_invariant_own

    model = _family("stablelm")
    model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out + 1e-3 * out.mean(0, keepdim=True))
    target, others = _prompts(model.config.vocab_size, 8)
    (alone,), _ = _run(model, [target], "alone")
    outs, _ = _run(model, [*others, target], "alone")
    assert same(outs[-1], alone)
    _trainer_equals_engine(model, target, alone)
    config = acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True, cpu_threads=1)
    with acb.Engine(model, config) as eng:
        assert "gave other bits than alone at step 1" in eng.runner.own_cache_runner.mode_rows_why
    monkeypatch.setattr(batch_invariant_own, "batched_rows_differ", lambda runner: None)
    outs, _ = _run(model, [*others, target], "batched")
    assert not same(outs[-1], alone)


def test_without_the_fixed_products_a_model_with_its_own_attention_is_refused(monkeypatch):
    """GPT-J computes its attention's products itself: the mode runs them by the fixed forms (the
    test above); without them its products are outside the fixed linear and attention, refused."""
    from acb.runner import batch_invariant_products

    monkeypatch.setattr(batch_invariant_products, "needs_fixed_products", lambda model: False)
    with pytest.raises(ValueError, match="GPTJAttention computes torch.matmul itself"):
        acb.Engine(_family("gptj"), acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True)).start()


@pytest.mark.parametrize(
    "arch, reason",
    [
        ("git", "its attention does not go through transformers' attention interface .GitSelfAttention computes "),
        # (its cache keeps a 16-token window; its whole-sequence forward attends to every key)
        ("moshi", "whole-sequence forward and its one-token form .* give other bits"),
    ],
)
def test_refused_with_the_reason(arch, reason):
    with pytest.raises(ValueError, match=reason):
        acb.Engine(_family(arch), acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True)).start()
