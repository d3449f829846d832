"""The batch-invariant mode on layers acb runs on the model's own cache (DeepSeek V4's sliding, CSA
and HCA attention: acb.runner.batch_invariant_unpaged): a request gives the same tokens and
logprob bits alone, in a batch of 24 requests of other lengths with its prompt cut by the step
budget, chunked at 7 tokens with async scheduling and preemption; and a trainer's forward under
``enabled(model)`` (a batch of two, the shorter right-padded; backward included) computes exactly
the engine's logprobs. (Prefix caching is off for these layers: there is no prefix hit to test.)"""

from __future__ import annotations

import random

import pytest
import torch

import acb
from acb.runner import batch_invariant as bi
from acb.runner import batch_invariant_unpaged as unpaged
from tests.runner.test_batch_invariant import TEMP, bits, same, together
from tests.runner.test_batch_invariant_families import SP, _family


def _run(model, prompts, **cfg):
    cfg.setdefault("num_blocks", 400)
    cfg.setdefault("page_size", 16)
    cfg.setdefault("cpu_threads", 2)
    config = acb.ContinuousBatchingConfig(batch_invariant=True, **cfg)
    with acb.Engine(model, config) as eng:
        got = together(eng, prompts, SP)
        stats = eng.stats
    return got, stats


@pytest.fixture(scope="module")
def model():
    return _family("deepseek_v4")  # sliding, CSA (indexer top-2 of entries pooled every 4), HCA (every 8)


@pytest.fixture(scope="module")
def prompts(model):
    vocab = model.config.vocab_size
    rng = random.Random(0)
    target = [rng.randrange(3, vocab) for _ in range(60)]  # 15 CSA entries (the indexer keeps 2), 7 HCA
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 20))] for _ in range(23)]
    return target, others


@pytest.fixture(scope="module")
def alone(model, prompts):
    return _run(model, [prompts[0]])[0][0]


@pytest.fixture(scope="module")
def batch(model, prompts):
    target, others = prompts
    return _run(model, [*others, target], max_batch_tokens=32)[0]  # the target's prompt cut by the budget


def test_alone_equals_in_a_batch_of_24_chunked_async_and_preempted(model, prompts, alone, batch):
    target, others = prompts
    assert same(batch[-1], alone)
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # chunked at 7 tokens, async scheduling, a cache too small for every row, one thread
        outs, stats = _run(
            model,
            [target, *others[:3]],
            max_batch_tokens=7,
            use_async_batching=True,
            num_blocks=24,
            page_size=4,
            cpu_threads=1,
        )
    finally:
        torch.set_num_threads(was)
    assert stats.preemptions > 0
    assert same(outs[0], alone)


def test_the_trainers_forward_computes_the_engines_logprobs_exactly(model, prompts, alone, batch):
    """Whole sequences, the shorter right-padded (its pads pooled into windows past its end, which
    no real query sees); the backward runs through the fixed forms and gives the plain forward's
    gradients up to rounding."""
    target, others = prompts
    rows = [(target, *alone), (others[0], *batch[0])]
    seqs = [p + t for p, t, _ in rows]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    m = _family("deepseek_v4")
    m.load_state_dict(model.state_dict())
    with bi.enabled(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        logits.float().logsumexp(-1)[mask.bool()].mean().backward()
    for row, (p, t, want) in enumerate(rows):
        got = bi.token_logprobs(logits[row, len(p) - 1 : len(p) + len(t) - 1], t, TEMP).double()
        assert torch.equal(got, want), (got - want).abs().max()
    assert m.config._attn_implementation == "eager"  # its own attention back after the block
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert any("compressor.kv_proj" in n for n in got) and any("o_a_proj" in n for n in got)
    m.zero_grad()
    m(input_ids=ids, attention_mask=mask).logits.float().logsumexp(-1)[mask.bool()].mean().backward()
    for n, p in m.named_parameters():
        if n in got:
            assert torch.allclose(got[n], p.grad, rtol=1e-3, atol=1e-5), n


def test_a_left_padded_row_is_refused_with_the_reason(model):
    """The compressor pools windows from the call's first token, pads included: a left-padded row
    cannot give the engine's entries, and the mode says so rather than return other logprobs."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 0, 0, 8, 9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    with bi.enabled(model), torch.no_grad(), pytest.raises(ValueError, match="pad on the right"):
        model(input_ids=ids, attention_mask=mask)


def test_the_fixed_forms_give_an_element_its_bits_whatever_the_shape():
    """The compressor's pooling takes a softmax over each window's slots (not the last dimension):
    torch's gives a window other bits as the number of windows in the call changes; the fixed
    softmax, sum and product do not move."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 10, 8, 16, generator=g)
    x[:, 0, :4] = float("-inf")  # (the first window's empty overlap half, as the model lays it out)
    with bi.engine_step(False):
        whole = unpaged.fixed_softmax(x, 2)
        assert all(torch.equal(unpaged.fixed_softmax(x[:, :n], 2), whole[:, :n]) for n in range(1, 10))
        assert all(torch.equal(unpaged.fixed_softmax(x[:, i : i + 1], 2), whole[:, i : i + 1]) for i in range(10))
        assert torch.allclose(whole, x.softmax(2), rtol=1e-6, atol=1e-7)
        s = unpaged.fixed_sum(x[:, 1:], 2)
        assert all(torch.equal(unpaged.fixed_sum(x[:, 1 + i : 2 + i], 2), s[:, i : i + 1]) for i in range(9))
        q, k = torch.randn(1, 12, 8, 16, generator=g), torch.randn(1, 1, 16, 9, generator=g)
        prod = unpaged.fixed_matmul(q, k)
        assert all(
            torch.equal(unpaged.fixed_matmul(q[:, :n], k[..., :j]), prod[:, :n, :, :j]) for n, j in [(1, 1), (5, 3)]
        )
        assert torch.allclose(prod, q @ k, rtol=1e-5, atol=1e-5)
    scores = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, float("-inf"), float("-inf")]])  # ReLU'd ties at 0
    picked = unpaged.fixed_topk(scores, 3).indices
    assert picked.tolist() == [[1, 0, 2]]
    assert all(torch.equal(unpaged.fixed_topk(scores[:, :n], 3).indices, picked) for n in range(4, 8))
    moved = sum(not torch.equal(x[:, :n].softmax(2), x.softmax(2)[:, :n]) for n in range(1, 10))
    if moved == 0:
        pytest.skip("this CPU's softmax gives a window the same bits here (nothing to show)")


def test_a_trainer_forward_while_the_engine_generates_on_the_same_model(model, prompts, alone):
    """Async RL on one model: while a mode engine generates (the target chunked at 7 tokens, under
    the window, so the first chunk's mask is a mask function's "causal", None), this thread's
    forwards under enabled(model) switch the engine's layers' own attention and mask to the mode's
    transformers ones between steps; both sides keep the bits they give alone."""
    target, others = prompts
    tokens, lps = alone
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=400, batch_invariant=True, max_batch_tokens=7)
    with acb.Engine(model, config) as eng:
        handles = [eng.submit(p, SP) for p in others[:3]] + [eng.submit(target, SP)]
        got = []
        while not handles[-1].done or len(got) < 2:
            with bi.enabled(model), torch.no_grad():
                logits = model(torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
            got.append(bi.token_logprobs(logits, tokens, TEMP).double())
        out = handles[-1].result()
        [h.result() for h in handles]
    assert all(torch.equal(g, lps) for g in got)
    assert same(bits(out), alone)
    assert model.config._attn_implementation == "eager"


def test_layers_whose_own_attention_is_not_the_eager_one_are_refused(model):
    """The mode's fixed form takes the place of the model module's eager attention function: a
    model set to another implementation is refused with the reason."""
    model.config._attn_implementation = "sdpa"
    try:
        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            acb.Engine(model, acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True)).start()
    finally:
        model.config._attn_implementation = "eager"
