"""The batch-invariant mode (``batch_invariant=True``, acb.runner.batch_invariant): a request's tokens
and logprobs are the same bits alone and in a batch of 64 requests of other lengths, chunked,
after a prefix hit, preempted, with async batching, at 1 and 2 threads; and a trainer's own
forward under ``enabled(model)`` computes exactly the logprobs the engine returned (backward
included). Without the mode these differ in the last bits (benchmarks/batch_invariance.py)."""

from __future__ import annotations

import random

import pytest
import torch

import acb
from acb.models import tiny_model
from acb.runner import batch_invariant as bi

TEMP = 0.9
SP = acb.SamplingParams(
    max_new_tokens=10,
    ignore_eos=True,
    do_sample=True,
    temperature=TEMP,
    top_k=0,
    top_p=1.0,
    seed=7,
    logprobs=0,
    logprobs_mode="processed",
)
GREEDY = acb.SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, hidden_size=128, intermediate_size=352, vocab_size=1000)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    target = [rng.randrange(3, 1000) for _ in range(37)]
    others = [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 90))] for _ in range(63)]
    return target, others


def _run(model, prompts, sampling, threads=2, cpu_threads=None, **cfg):
    """Every prompt submitted while the engine is paused (they enter its first step together);
    each output's (tokens, logprobs)."""
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    cfg.setdefault("num_blocks", 400)
    config = acb.ContinuousBatchingConfig(page_size=16, batch_invariant=True, cpu_threads=cpu_threads or threads, **cfg)
    try:
        with acb.Engine(model, config) as eng:
            got = together(eng, prompts, sampling)
            stats = eng.stats
    finally:
        torch.set_num_threads(was)
    return got, stats


def together(eng, prompts, sampling=SP, **submit):
    """``prompts`` submitted while ``eng`` is paused (they enter its first step together), with
    ``sampling`` (one for all, or one each); each output's (tokens, float64 logprobs)."""
    each = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    eng.pause()
    handles = [eng.submit(p, s, **submit) for p, s in zip(prompts, each, strict=True)]
    eng.resume()
    return [bits(h.result()) for h in handles]


def bits(out):
    """An output's (tokens, logprobs as float64): what the mode's tests compare with :func:`same`."""
    return out.generated_tokens, torch.tensor(out.logprobs, dtype=torch.float64)


def same(a, b):
    """The same tokens and the same logprob bits."""
    return a[0] == b[0] and torch.equal(a[1], b[1])


@pytest.fixture(scope="module")
def alone(model, prompts):
    target, _ = prompts
    (sampled, greedy), _ = _run(model, [target, target], [SP, GREEDY])
    return sampled, greedy


def test_alone_equals_in_a_batch_of_64_first_and_last(model, prompts, alone):
    target, others = prompts
    sps = [SP] + [GREEDY] * 62 + [SP]
    outs, _ = _run(model, [target, *others[:62], target], sps)
    assert same(outs[0], alone[0]) and same(outs[-1], alone[0])
    outs, _ = _run(model, [*others[:63], target], [SP] * 63 + [GREEDY])  # greedy, the batch sampled
    assert same(outs[-1], alone[1])


def test_chunked_async_preempted_and_one_thread(model, prompts, alone):
    target, others = prompts
    # chunked prefill (16-token steps), async scheduling, a cache too small for every row (preemption)
    outs, stats = _run(
        model,
        [*others[:15], target],
        [GREEDY] * 15 + [SP],
        max_batch_tokens=16,
        use_async_batching=True,
        num_blocks=12,
    )
    assert same(outs[-1], alone[0])
    assert stats.preemptions > 0
    outs, _ = _run(model, [target, *others[:20]], [SP] + [GREEDY] * 20, threads=1)
    assert same(outs[0], alone[0])


def test_after_a_prefix_hit(model, prompts, alone):
    target, _ = prompts
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=400, batch_invariant=True)
    with acb.Engine(model, config) as eng:
        eng.generate(target[:33] + [5, 6], acb.SamplingParams(max_new_tokens=1))
        out = eng.submit(target, SP).result()
        assert eng.stats.prefix_hits >= 32
    assert same(bits(out), alone[0])


def test_the_trainers_forward_computes_the_engines_logprobs_exactly(model, prompts, alone):
    """Under enabled(model) the trainer's forward (whole sequences, a batch of two, the shorter
    one left-padded as trainers pad prompts) gives each completion token exactly the engine's
    logprob; the backward runs and its gradients are the plain forward's up to rounding."""
    target, others = prompts
    tokens, lps = alone[0]
    short = others[3][:20]
    s_tokens, s_lps = _run(model, [short], [SP])[0][0]
    seqs = [target + tokens, short + s_tokens]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # each sequence's positions from 0, as in the engine
    m = tiny_model("llama", seed=1, hidden_size=128, intermediate_size=352, vocab_size=1000)
    m.load_state_dict(model.state_dict())
    with bi.enabled(m):
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for row, (p, t, want) in enumerate([(target, tokens, lps), (short, s_tokens, s_lps)]):
        start = width - len(p) - len(t)
        got = bi.token_logprobs(logits[row, start + len(p) - 1 : width - 1], t, TEMP).double()
        assert torch.equal(got, want), (got - want).abs().max()
    assert m.config._attn_implementation == "sdpa"  # its own attention back after the block
    # the backward: gradients through the fixed-order ops equal the plain forward's to rounding
    m.zero_grad()
    with bi.enabled(m):
        loss = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().logsumexp(-1).mean()
    loss.backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    m(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().logsumexp(-1).mean().backward()
    assert got and all(
        torch.allclose(got[n], p.grad, rtol=1e-3, atol=1e-5) for n, p in m.named_parameters() if n in got
    )


def test_the_linear_is_row_invariant_here():
    assert bi.check_linear([(64, 192), (128, 1000), (1024, 1024), (2048, 256)], threads=(1, 2)) is None


@pytest.mark.parametrize(
    "make,why",
    [
        # (state layers: every class found has a fixed form; tests/runner/test_batch_invariant_families.py)
        (lambda: tiny_model("llama", dtype=torch.bfloat16), "float32 only"),
    ],
)
def test_what_the_mode_does_not_cover_is_refused_with_the_reason(make, why):
    with pytest.raises(ValueError, match=why):
        acb.Engine(make(), acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True)).start()


def test_other_backends_are_refused():  # (LoRA: tests/runner/test_batch_invariant_families.py)
    m = tiny_model("llama")
    for cfg, why in (({"attn_backend": "torch"}, "attn_backend='torch'"),):
        with pytest.raises(ValueError, match=why):
            acb.Engine(m, acb.ContinuousBatchingConfig(num_blocks=16, batch_invariant=True, **cfg)).start()


def _family(model_type, dense=False):
    from transformers import AutoModelForCausalLM

    from acb.bench.families import tiny_config

    cfg = tiny_config(model_type)
    if dense:  # every layer's MLP dense (DeepSeek V3's first_k_dense_replace)
        cfg.first_k_dense_replace = cfg.num_hidden_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_the_flag_reaches_the_engine_config():
    from acb.cli import build_parser
    from acb.cli.common import engine_config

    for command in ("serve", "generate"):
        assert engine_config(build_parser().parse_args([command, "--batch-invariant"])).batch_invariant is True
        assert engine_config(build_parser().parse_args([command])).batch_invariant is False


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_mla_and_moe_alone_equal_a_batch_of_64_and_the_trainer(arch):
    """A DeepSeek-V3-shaped MLA model (dense MLPs: its MoE router is refused) and a Qwen3-MoE
    (transformers' grouped_mm experts): a 100-token request alone, in a batch of 64 and at 1
    thread gives the same bits, and the trainer's forward under enabled(model) the same logprobs."""
    model = _family(arch, dense=arch == "deepseek_v3")
    vocab = model.config.vocab_size
    rng = random.Random(0)
    target = [rng.randrange(3, vocab) for _ in range(100)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(63)]
    (alone,), _ = _run(model, [target], [SP])
    outs, _ = _run(model, [*others, target], [GREEDY] * 63 + [SP])
    assert same(outs[-1], alone)
    outs, _ = _run(model, [target, *others[:8]], [SP] + [GREEDY] * 8, threads=1)
    assert same(outs[0], alone)
    with bi.enabled(model), torch.no_grad():
        logits = model(torch.tensor([target + alone[0]])).logits[0, len(target) - 1 : -1]
    assert torch.equal(bi.token_logprobs(logits, alone[0], TEMP).double(), alone[1])


def test_a_trainer_forward_while_the_engine_generates_on_the_same_model(model, prompts, alone):
    """Async RL: the trainer's forward under enabled(model) on this thread while a mode engine
    on the same model generates on its own; each gets its own attention (the engine's steps keep
    the paged one), and both give the bits they give alone."""
    target, others = prompts
    tokens, lps = alone[0]
    config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=400, batch_invariant=True)
    with acb.Engine(model, config) as eng:
        handles = [eng.submit(p, GREEDY) for p in others[:40]] + [eng.submit(target, SP)]
        got = []
        while not handles[-1].done or len(got) < 2:
            with bi.enabled(model), torch.no_grad():
                logits = model(torch.tensor([target + tokens])).logits[0, len(target) - 1 : -1]
            got.append(bi.token_logprobs(logits, tokens, TEMP).double())
        out = handles[-1].result()
        [h.result() for h in handles]
    assert all(torch.equal(g, lps) for g in got)
    assert same(bits(out), alone[0])
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "arch,act,width",
    [("llama", "silu", 76), ("gemma", "gelu_pytorch_tanh", 100)],
)
def test_activation_widths_off_the_vector_block_stay_invariant(arch, act, width):
    """An MLP whose width (76, 100) is not a multiple of the vector block: torch would compute a
    step's last few activations (SiLU, GELU-tanh) on its scalar path, in other bits than the
    vector path's, so a token's bits would follow the step's token count. In the mode every
    element-wise transcendental of the forward takes one path: alone, in a batch of 64, chunked,
    at 1 thread and in the trainer's forward give the same bits."""
    model = tiny_model(arch, seed=3, hidden_size=64, intermediate_size=width, vocab_size=500, hidden_act=act)
    if arch == "gemma":
        model.config.hidden_activation = act
    rng = random.Random(1)
    target = [rng.randrange(3, 500) for _ in range(37)]
    others = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(63)]
    (alone,), _ = _run(model, [target], [SP])
    outs, _ = _run(model, [*others, target], [GREEDY] * 63 + [SP])
    assert same(outs[-1], alone), (outs[-1][1] - alone[1]).abs().max()
    outs, _ = _run(model, [*others[:7], target], [GREEDY] * 7 + [SP], max_batch_tokens=16, threads=1)
    assert same(outs[-1], alone), (outs[-1][1] - alone[1]).abs().max()
    with bi.enabled(model), torch.no_grad():
        logits = model(torch.tensor([target + alone[0]])).logits[0, len(target) - 1 : -1]
    got = bi.token_logprobs(logits, alone[0], TEMP).double()
    assert torch.equal(got, alone[1]), (got - alone[1]).abs().max()


def test_the_vector_path_gives_an_element_the_same_bits_at_any_position_length_and_thread_count():
    """The mode's element-wise form (acb.runner.batch_invariant_families.vector_path): an element's
    bits the same at any offset, in any call length (past torch's thread split), at 1 and 2 threads,
    where torch's own call moves them (its scalar tail)."""
    import functools

    import torch.nn.functional as F

    from acb.runner import batch_invariant_families as fam

    x = torch.randn(70_000, generator=torch.Generator().manual_seed(0)) * 4
    was = torch.get_num_threads()
    try:
        for fn in (torch.sigmoid, F.silu, functools.partial(F.gelu, approximate="tanh"), F.softplus):
            torch.set_num_threads(2)
            whole = fam.vector_path(fn, x)
            assert all(torch.equal(fam.vector_path(fn, x[:n]), whole[:n]) for n in [*range(1, 70), 16385, 40001])
            assert all(torch.equal(fam.vector_path(fn, x[s : s + 777]), whole[s : s + 777]) for s in (1, 33, 16000))
            assert torch.allclose(whole, fn(x), rtol=1e-6, atol=1e-6)
            torch.set_num_threads(1)
            assert torch.equal(fam.vector_path(fn, x), whole)
    finally:
        torch.set_num_threads(was)
