"""The batch-invariant mode's GPU kernels (acb.runner.batch_invariant_kernels, and the Triton
attention backend's fixed-order form), run as their CPU twins under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported); on a CUDA machine with
``TRITON_INTERPRET=0`` the same tests run the compiled kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from acb.runner import batch_invariant as bi  # noqa: E402
from acb.runner import batch_invariant_kernels as bk  # noqa: E402
from acb.runner import batch_invariant_scope as scope  # noqa: E402
from tests.conftest import triton_test_device  # noqa: E402

DEVICE = triton_test_device()

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")] + (
    [pytest.mark.gpu] if DEVICE.type == "cuda" else []
)

# K and N not multiples of the tiles; M up to one full tile
K, N = 80, 72
ROWS = (1, 2, 3, 17, 64)


def _rand(*shape, g, dtype):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_row_bits_do_not_depend_on_the_batch(dtype):
    """A row's output bits are those it gets alone, for every row count, position and other rows;
    and the product is torch's up to rounding."""
    g = torch.Generator().manual_seed(0)
    w = _rand(N, K, g=g, dtype=dtype)
    bias = _rand(N, g=g, dtype=dtype)
    x0 = _rand(1, K, g=g, dtype=dtype)
    alone = bk.matmul(x0, w, bias)[0]
    for m in ROWS:
        for pos in sorted({0, m // 2, m - 1}):
            x = _rand(m, K, g=g, dtype=dtype)
            x[pos] = x0[0]
            out = bk.matmul(x, w, bias)
            assert torch.equal(out[pos], alone), (dtype, m, pos)
            want = x.float() @ w.float().T + bias.float()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * 4)


def test_matmul_takes_strided_operands_and_no_bias():
    g = torch.Generator().manual_seed(1)
    w_t = _rand(K, N, g=g, dtype=torch.float32)  # weight given as a transposed view
    x = _rand(K, 5, g=g, dtype=torch.float32).T  # [5, K] with non-unit row stride
    out = bk.matmul(x, w_t.T)
    torch.testing.assert_close(out, x @ w_t, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], bk.matmul(x[3:4].contiguous(), w_t.T.contiguous())[0])
    with pytest.raises(ValueError, match="one dtype"):
        bk.matmul(x.to(torch.bfloat16), w_t.T)


@pytest.fixture
def kernel_form():
    """The mode's linear in its CUDA form on CPU tensors (under the interpreter)."""
    was = bi.KERNEL
    bi.KERNEL = DEVICE.type == "cpu"
    yield
    bi.KERNEL = was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_linear_dispatches_to_the_kernel(kernel_form, dtype):
    """The mode's linear (what every nn.Linear and the LM head call with the mode on) is the Triton
    matmul on the CUDA path: the same bits, bf16 taken, differentiable."""
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(K, N).to(dtype).to(DEVICE)
    x = _rand(3, 4, K, g=g, dtype=dtype)
    with bi.enabled():
        got = lin(x)
    assert got.shape == (3, 4, N) and got.dtype == dtype
    assert torch.equal(got, bk.linear(x, lin.weight.detach(), lin.bias.detach()))
    assert torch.equal(got[1, 2], bk.linear(x[1, 2:3], lin.weight.detach(), lin.bias.detach())[0])
    xg = x.detach().clone().requires_grad_(True)
    with bi.enabled():
        bi.linear(xg, lin.weight, lin.bias).float().sum().backward()
    assert xg.grad is not None and lin.weight.grad is not None
    torch.testing.assert_close(
        xg.grad.float(), lin.weight.detach().float().sum(0).expand(3, 4, K), rtol=2e-2, atol=2e-2
    )


# --- attention: the Triton backend's fixed-order form ----------------------------------------------


def _step(backend, cache, call, bt_rows, num_new, start_pos, q_rows, bs):
    """One attention step of ``backend`` over ``cache``: sequences with block-table rows
    ``bt_rows``, their new tokens' queries ``q_rows`` ([T, H, D]); the new keys and values are
    the cache's own at those slots (so every step sees the same cache)."""
    from acb.runner.attention import BatchInputs, StepContext

    bt = torch.stack(bt_rows)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_pos, num_new)]).to(DEVICE)
    seq_of = torch.repeat_interleave(torch.arange(len(num_new), device=DEVICE), torch.tensor(num_new, device=DEVICE))
    slots = bt[seq_of, pos // bs] * bs + pos % bs
    seq_lens = [s + n for s, n in zip(start_pos, num_new)]
    batch = BatchInputs(
        slot_mapping=slots,
        block_table=bt,
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], device=DEVICE),
        num_new=num_new,
        start_pos=start_pos,
        max_seq_len=max(seq_lens),
    )
    flat_k = cache.k[0].flatten(0, 1)
    flat_v = cache.v[0].flatten(0, 1)
    key = flat_k[slots][None].transpose(1, 2)  # [1, Hkv, T, D]
    value = flat_v[slots][None].transpose(1, 2)
    query = q_rows[None].transpose(1, 2)  # [1, H, T, D]
    ctx = StepContext(cache, backend, backend.build_metadata(batch, bs))
    return backend.forward(0, query, key, value, ctx, call)[0]  # [T, H, D]


@pytest.mark.parametrize("dtype,features", [(torch.bfloat16, "plain"), (torch.float32, "window_sinks_softcap")])
def test_fixed_order_attention_gives_a_query_the_same_bits_in_prefill_and_decode(dtype, features):
    """In the mode a query's attention output has the same bits in a prefill chunk (among other
    sequences' chunks and decode rows), in another chunking of its prompt, and as a decode row
    alone or among others; a decode step's graph variants are one split. (Without the mode a
    decode row over 290+ keys alone takes two splits and the chunk one pass: other bits.)"""
    from acb.runner.attention import AttentionCall
    from acb.runner.attention.triton_backend import TritonBackend
    from acb.runner.kv_cache import KVCache, KVSpec

    bs, hkv, heads, d, nb = 16, 2, 4, 16, 32
    g = torch.Generator().manual_seed(5)
    cache = KVCache(KVSpec.uniform(1, hkv, d, dtype), nb, bs, DEVICE)
    cache.k[0].copy_(_rand(*cache.k[0].shape, g=g, dtype=dtype))
    cache.v[0].copy_(_rand(*cache.v[0].shape, g=g, dtype=dtype))
    perm = (torch.randperm(nb - 1, generator=g) + 1).to(DEVICE)
    x_row, a_row, b_row = perm[:19], perm[19:21].repeat(10)[:19], perm[21:23].repeat(10)[:19]
    if features == "plain":
        call = AttentionCall(scaling=0.25)
    else:
        call = AttentionCall(scaling=0.25, sliding_window=100, softcap=4.0, sinks=_rand(heads, g=g, dtype=dtype))
    x_q = _rand(4, heads, d, g=g, dtype=dtype)  # sequence X's queries at positions 290..293 (290 cached)
    other = _rand(8, heads, d, g=g, dtype=dtype)
    mode = TritonBackend(fixed_order=True)
    assert mode.graph_variants(64, hkv, 100_000, torch.device(DEVICE)) == [1]
    # a mixed step: a decode row, X's chunk after its cached prefix, another sequence's chunk
    rows3 = [a_row, x_row, b_row]
    mixed = _step(mode, cache, call, rows3, [1, 4, 3], [20, 290, 3], torch.cat([other[:1], x_q, other[1:4]]), bs)[1:5]
    # X's chunk cut in two
    first = _step(mode, cache, call, [x_row], [2], [290], x_q[:2], bs)
    second = _step(mode, cache, call, [a_row, x_row], [1, 2], [21, 292], torch.cat([other[4:5], x_q[2:]]), bs)[1:]
    assert torch.equal(torch.cat([first, second]), mixed)
    alone = _step(mode, cache, call, [x_row], [1], [293], x_q[3:], bs)[0]  # X's last query as a decode row
    assert torch.equal(alone, mixed[3])
    among = _step(mode, cache, call, rows3, [1, 1, 1], [30, 291, 11], torch.stack([other[5], x_q[1], other[6]]), bs)[1]
    assert torch.equal(among, mixed[1])


# --- RMSNorm's mean, and a trainer's attention over whole sequences -------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_row_mean_row_bits_and_the_dispatch_mode(dtype):
    """:func:`row_mean` gives a row its bits alone whatever else is in the call and is torch's mean
    up to rounding; under :class:`FixedReductions` an RMSNorm's ``pow(2).mean(-1, keepdim=True)``
    is it (other reductions are torch's)."""
    g = torch.Generator().manual_seed(3)
    n = 1500  # over one 1024-wide strip
    x0 = _rand(1, n, g=g, dtype=dtype)
    alone = bk.row_mean(x0.float().pow(2), keepdim=True)[0]
    for m in ROWS:
        x = _rand(m, n, g=g, dtype=dtype)
        x[m // 2] = x0[0]
        got = bk.row_mean(x.float().pow(2), keepdim=True)
        assert torch.equal(got[m // 2], alone), m
        torch.testing.assert_close(got, x.float().pow(2).mean(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    x = _rand(3, 5, n, g=g, dtype=dtype)
    with bk.FixedReductions(lambda t: True):
        rms = x.float().pow(2).mean(-1, keepdim=True)
        plain = x.float().mean(0)  # not over the last dim: torch's
        typed = x.mean(-1, dtype=torch.float32)
    assert torch.equal(rms, bk.row_mean(x.float().pow(2), keepdim=True)) and rms.shape == (3, 5, 1)
    assert torch.equal(plain, x.float().mean(0))
    assert typed.dtype == torch.float32 and torch.equal(typed, bk.row_mean(x, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_sequence_attention_equals_the_engines_fixed_order_attention(dtype):
    """A trainer's forward over whole (left-padded) sequences through
    :func:`whole_sequence_attention` gives each query the bits the Triton backend's fixed-order
    form gives it over an engine's paged cache (a prompt's chunk after its cached prefix)."""
    from acb.runner.attention import AttentionCall
    from acb.runner.attention.triton_backend import TritonBackend
    from acb.runner.kv_cache import KVCache, KVSpec

    bs, hkv, heads, d, nb, s, q = 16, 2, 4, 16, 16, 70, 5
    g = torch.Generator().manual_seed(4)
    pads = [0, 3]
    key = _rand(2, hkv, s, d, g=g, dtype=dtype)
    value = _rand(2, hkv, s, d, g=g, dtype=dtype)
    query = _rand(2, heads, q, d, g=g, dtype=dtype)
    sinks = _rand(heads, g=g, dtype=dtype)
    whole = bk.whole_sequence_attention(query, key, value, pads, 0.25, softcap=4.0, window=40, sinks=sinks)
    cache = KVCache(KVSpec.uniform(1, hkv, d, dtype), nb, bs, DEVICE)
    call = AttentionCall(scaling=0.25, sliding_window=40, softcap=4.0, sinks=sinks)
    mode = TritonBackend(fixed_order=True)
    rows = [torch.arange(1, 6, device=DEVICE), torch.arange(6, 11, device=DEVICE)]
    for r, pad in enumerate(pads):  # each row's tokens (from its first unpadded one) as a sequence's
        n = s - pad
        cache.k[0].flatten(0, 1)[(rows[r][:, None] * bs + torch.arange(bs, device=DEVICE)).reshape(-1)[:n]] = key[
            r, :, pad:
        ].transpose(0, 1)
        cache.v[0].flatten(0, 1)[(rows[r][:, None] * bs + torch.arange(bs, device=DEVICE)).reshape(-1)[:n]] = value[
            r, :, pad:
        ].transpose(0, 1)
        got = _step(mode, cache, call, [rows[r]], [q], [n - q], query[r].transpose(0, 1), bs)
        assert torch.equal(got, whole[r]), r


# --- a trainer's forward on the CUDA path -----------------------------------------------------------


def test_trainers_forward_on_the_kernel_path_is_batch_invariant(kernel_form, monkeypatch):
    """Under ``enabled(model)`` on the CUDA path (every linear the Triton matmul, RMSNorm's mean the
    row kernel, attention the decode kernel over whole sequences), a sequence's logits have the
    same bits alone and in a padded batch (right and left padding, other rows of other lengths)."""
    from acb.models import tiny_model

    model = tiny_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, dtype=torch.float32,
    ).to(DEVICE)  # fmt: skip
    calls = {"attention": 0, "mean": 0}

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(bk, "whole_sequence_attention", counted("attention", bk.whole_sequence_attention))
    monkeypatch.setattr(bk, "row_mean", counted("mean", bk.row_mean))
    g = torch.Generator().manual_seed(6)
    seq = torch.randint(3, 96, (6,), generator=g).tolist()
    others = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (9, 2)]

    def logits(rows: list[list[int]], left: bool) -> torch.Tensor:
        w = max(map(len, rows))
        pad = [[0] * (w - len(r)) for r in rows]
        ids = torch.tensor([p + r if left else r + p for r, p in zip(rows, pad)], device=DEVICE)
        mask = torch.tensor(
            [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p) for r, p in zip(rows, pad)],
            device=DEVICE,
        )
        with torch.no_grad(), bi.enabled(model):
            # positions from each row's first token (as acb.integrations.trl's trainer side gives them)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        return out[0, w - len(rows[0]) :] if left else out[0, : len(rows[0])]

    alone = logits([seq], False)
    assert calls == {"attention": 1, "mean": 3}  # one layer: its attention; its two norms and the final one
    assert torch.equal(logits([seq, *others], False), alone)
    assert torch.equal(logits([seq, *others], True), alone)
    torch.testing.assert_close(
        alone, model(input_ids=torch.tensor([seq], device=DEVICE)).logits[0], rtol=1e-4, atol=1e-4
    )


def test_engine_on_the_kernel_path_alone_equals_batched_chunked_and_the_trainer(kernel_form):
    """An engine in the mode on the CUDA path (run here under the interpreter: the Triton matmul,
    the row mean, the Triton backend's fixed-order attention) gives a request the same tokens and
    logprobs alone and among others with its prompt chunked, and a trainer's forward under
    ``enabled(model)`` gives those logprobs exactly."""
    import acb
    from acb.models import tiny_model

    model = tiny_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, dtype=torch.float32,
    ).to(DEVICE)  # fmt: skip
    g = torch.Generator().manual_seed(8)
    target = torch.randint(3, 96, (11,), generator=g).tolist()
    others = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 3)]

    def sp(seed: int) -> acb.SamplingParams:
        return acb.SamplingParams(
            max_new_tokens=4, ignore_eos=True, do_sample=True, temperature=0.9, top_k=0, top_p=1.0, seed=seed,
            logprobs=0, logprobs_mode="processed",
        )  # fmt: skip

    def run(prompts: list[list[int]], **cfg) -> acb.RequestOutput:
        config = acb.ContinuousBatchingConfig(page_size=16, num_blocks=32, batch_invariant=True, **cfg)
        with acb.Engine(model, config) as eng:
            assert eng.runner.backend.fixed_order and eng.runner.cfg.attn_backend == "triton"
            eng.pause()
            hs = [eng.submit(p, sp(7 if i == 0 else 50 + i)) for i, p in enumerate(prompts)]
            eng.resume()
            return hs[0].result()

    alone = run([target])
    batched = run([target, *others], max_batch_tokens=8)  # chunked prompts: mixed prefill and decode steps
    assert batched.generated_tokens == alone.generated_tokens and batched.logprobs == alone.logprobs
    ids = torch.tensor([target + alone.generated_tokens], device=DEVICE)
    with torch.no_grad(), bi.enabled(model):
        logits = model(input_ids=ids).logits[0, len(target) - 1 : -1]
    got = bi.token_logprobs(logits, alone.generated_tokens, 0.9)
    assert torch.equal(got, torch.tensor(alone.logprobs, dtype=got.dtype))


def test_what_the_cuda_path_does_not_cover_is_refused(kernel_form):
    """On the CUDA path the mode refuses what only its CPU path covers (MLA's expanded heads, the
    state layers' fixed forms), and dtypes its kernels do not take, with the reason."""
    from transformers import AutoModelForCausalLM

    import acb
    from acb.bench.families import tiny_config
    from acb.models import tiny_model

    config = acb.ContinuousBatchingConfig(batch_invariant=True)
    mla = tiny_config("deepseek_v3")
    mla.first_k_dense_replace = mla.num_hidden_layers  # (its MoE router is refused on every path)
    mamba = tiny_config("mamba2")
    for cfg, why in ((mla, "on CUDA, multi-head latent"), (mamba, "on CUDA, state layers")):
        assert why in (scope.refusal(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), config) or "")
    assert "bf16, fp16 or fp32" in scope.refusal(tiny_model("llama", dtype=torch.float64), config)
    assert scope.refusal(tiny_model("llama", dtype=torch.bfloat16), config) is None
