"""The Triton paged-attention kernels and backend against plain torch references.

Runs under the Triton interpreter on CPU (``TRITON_INTERPRET=1``, set here before triton is
imported). On a CUDA machine run with ``TRITON_INTERPRET=0`` to test the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import acb  # noqa: E402
from acb.models import tiny_model  # noqa: E402
from acb.runner.attention import AttentionCall, BatchInputs, StepContext, check_backend  # noqa: E402
from acb.runner.attention import triton_kernels as tk  # noqa: E402
from acb.runner.attention.torch_backend import TorchBackend  # noqa: E402
from acb.runner.attention.triton_backend import TritonBackend  # noqa: E402
from acb.runner.kv_cache import KVCache, KVSpec  # noqa: E402
from tests.conftest import triton_test_device  # noqa: E402

DEVICE = triton_test_device()

# the interpreter's own numpy deprecation noise; compiled for a GPU, these are `gpu` tests too
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")] + (
    [pytest.mark.gpu] if DEVICE.type == "cuda" else []
)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


# --- helpers -------------------------------------------------------------------------------------


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    return k, v


def make_block_table(seq_lens, block_size, num_blocks, seed=0, extra_cols=1):
    """Rows of shuffled, distinct block ids (never the scratch block 0); unused columns are 0."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    cols = max(need + [1]) + extra_cols
    assert sum(need) <= num_blocks - 1, "test cache too small"
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    bt = torch.zeros(len(seq_lens), cols, dtype=torch.long)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i : i + n], dtype=torch.long)
        i += n
    return bt.to(DEVICE)


def ref_attention(q, k_cache, v_cache, block_table, q_lens, seq_lens, scale, window=None, softcap=None):
    """fp32 reference: q [T, H, D] (sequences' queries back to back); returns [T, H, D] fp32."""
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    heads = q.shape[1]
    group = heads // kv_heads
    kf = k_cache.float().reshape(-1, kv_heads, head_dim)
    vf = v_cache.float().reshape(-1, kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    t = 0
    for b, (n, L) in enumerate(zip(q_lens, seq_lens)):
        if n == 0:
            continue
        if L == 0:
            t += n
            continue
        pos = torch.arange(L, device=q.device)
        slots = block_table[b][pos // block_size] * block_size + pos % block_size
        k = kf[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = vf[slots].repeat_interleave(group, dim=1)
        qq = q[t : t + n].float()  # [n, H, D]
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = (L - n + torch.arange(n, device=q.device))[:, None]
        vis = pos[None, :] <= qpos
        if window:
            vis &= pos[None, :] > qpos - window
        s = s.masked_fill(~vis[None], float("-inf"))
        out[t : t + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        t += n
    return out


def assert_close(got, want, dtype):
    tol = TOL[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# --- (a) store_kv --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv(dtype):
    nb, bs, hkv, d, t = 8, 4, 2, 32, 7
    k_cache, v_cache = make_cache(nb, bs, hkv, d, dtype)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 6, -1, 13, 31, -1, 4], dtype=torch.long, device=DEVICE)
    # transposed views, as the backend passes them ([1, Hkv, T, D] -> [T, Hkv, D])
    key = torch.randn(1, hkv, t, d, device=DEVICE).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, hkv, t, d, device=DEVICE).to(dtype)[0].transpose(0, 1)
    tk.store_kv(key, value, k_cache, v_cache, slots)
    keep = slots >= 0
    k0.view(-1, hkv, d)[slots[keep]] = key[keep]
    v0.view(-1, hkv, d)[slots[keep]] = value[keep]
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


# --- (b) decode ----------------------------------------------------------------------------------

DECODE_CASES = [
    # group, dtype, head_dim, block_size, num_splits, window, softcap
    (1, torch.float32, 16, 4, 1, None, None),
    (2, torch.float32, 32, 8, 4, None, None),
    (4, torch.float32, 16, 4, 3, None, None),
    (2, torch.float32, 16, 4, None, None, None),  # automatic split count
    (2, torch.float32, 16, 8, 4, 20, None),  # sliding window, split over the window only
    (1, torch.float32, 32, 4, 2, None, 5.0),  # softcap
    (2, torch.float16, 32, 8, 4, 30, 8.0),
    (4, torch.bfloat16, 16, 4, 3, None, None),
    (2, torch.float16, 80, 8, 1, None, None),  # non power-of-two head_dim
]


@pytest.mark.parametrize("group,dtype,head_dim,block_size,num_splits,window,softcap", DECODE_CASES)
def test_paged_decode_attention(group, dtype, head_dim, block_size, num_splits, window, softcap):
    hkv = 2
    heads = hkv * group
    # padded row (0), length 1, partial last blocks, one long enough for several 64-token splits
    seq_lens = [37, 1, 0, 9, 200, 16]
    nb = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache, v_cache = make_cache(nb, block_size, hkv, head_dim, dtype, seed=group)
    bt = make_block_table(seq_lens, block_size, nb, seed=group)
    q = torch.randn(len(seq_lens), heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=DEVICE)
    scale = head_dim**-0.5
    got = tk.paged_decode_attention(
        q, k_cache, v_cache, bt, lens, scale, window, softcap, num_splits, max_seq_len=max(seq_lens)
    )
    want = ref_attention(q, k_cache, v_cache, bt, [1] * len(seq_lens), seq_lens, scale, window, softcap)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, dtype)
    assert torch.equal(got[2].float(), torch.zeros_like(got[2].float()))  # seq_len 0 -> zeros


def test_choose_num_splits():
    assert tk.choose_num_splits(4, 2, 100) == 1
    assert tk.choose_num_splits(1, 2, 4096) == 16
    assert tk.choose_num_splits(1, 1, 100_000) == tk.MAX_SPLITS
    assert tk.choose_num_splits(256, 8, 4096) == 1  # the batch fills the machine


# --- (c) prefill ---------------------------------------------------------------------------------

PREFILL_CASES = [
    # group, dtype, head_dim, block_size, window, softcap
    (1, torch.float32, 16, 4, None, None),
    (2, torch.float32, 32, 8, None, None),
    (4, torch.float32, 16, 4, 6, None),
    (2, torch.float32, 16, 8, None, 4.0),
    (2, torch.float16, 32, 4, 11, 6.0),
    (2, torch.bfloat16, 16, 8, None, None),
]


@pytest.mark.parametrize("group,dtype,head_dim,block_size,window,softcap", PREFILL_CASES)
def test_paged_prefill_attention(group, dtype, head_dim, block_size, window, softcap):
    hkv = 2
    heads = hkv * group
    # (queries, context): full prefill, chunks after a cached prefix, one query, >64 queries (two q tiles)
    q_lens = [7, 5, 1, 70, 3]
    seq_lens = [7, 12, 9, 75, 3]
    nb = sum(-(-n // block_size) for n in seq_lens) + 4
    k_cache, v_cache = make_cache(nb, block_size, hkv, head_dim, dtype, seed=group + 10)
    bt = make_block_table(seq_lens, block_size, nb, seed=group + 10)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.long, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=DEVICE)
    scale = 0.3
    got = tk.paged_prefill_attention(q, k_cache, v_cache, bt, qsl, lens, max(q_lens), scale, window, softcap)
    want = ref_attention(q, k_cache, v_cache, bt, q_lens, seq_lens, scale, window, softcap)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, dtype)


# --- the backend against TorchBackend ------------------------------------------------------------


@pytest.mark.parametrize(
    "num_new,start_pos,window,softcap",
    [
        ([1, 1, 1, 1], [6, 0, 30, 12], None, None),  # decode-only step
        ([1, 9, 1, 4, 1], [20, 0, 3, 11, 0], None, None),  # mixed: decode rows + prefill chunks
        ([1, 9, 1, 4, 1], [20, 0, 3, 11, 0], 7, None),
        ([12, 1, 5], [0, 33, 8], None, 3.0),
    ],
)
def test_backend_matches_torch(num_new, start_pos, window, softcap):
    bs, hkv, heads, d, nb = 4, 2, 4, 16, 64
    dtype = torch.float32
    seq_lens = [s + n for s, n in zip(start_pos, num_new)]
    spec = KVSpec.uniform(1, hkv, d, dtype)
    caches = [KVCache(spec, nb, bs, DEVICE) for _ in range(2)]
    k0, v0 = make_cache(nb, bs, hkv, d, dtype, seed=3)  # the cached prefixes
    for c in caches:
        c.k[0].copy_(k0)
        c.v[0].copy_(v0)
    bt = make_block_table(seq_lens, bs, nb, seed=3, extra_cols=0)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_pos, num_new)]).to(DEVICE)
    seq_of = torch.repeat_interleave(torch.arange(len(num_new), device=DEVICE), torch.tensor(num_new, device=DEVICE))
    slots = bt[seq_of, pos // bs] * bs + pos % bs
    qsl = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist(), dtype=torch.long, device=DEVICE)
    batch = BatchInputs(
        slot_mapping=slots,
        block_table=bt,
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        query_start_loc=qsl,
        num_new=num_new,
        start_pos=start_pos,
        max_seq_len=max(seq_lens),
    )
    t = len(slots)
    # transformers hands attention [1, H, T, D] views of [1, T, H, D] tensors
    query = torch.randn(1, t, heads, d, device=DEVICE).transpose(1, 2)
    key = torch.randn(1, t, hkv, d, device=DEVICE).transpose(1, 2)
    value = torch.randn(1, t, hkv, d, device=DEVICE).transpose(1, 2)
    outs = []
    for backend, cache in zip((TorchBackend(), TritonBackend()), caches):
        ctx = StepContext(cache, backend, backend.build_metadata(batch, bs))
        outs.append(
            backend.forward(
                0, query, key, value, ctx, AttentionCall(scaling=0.25, sliding_window=window, softcap=softcap)
            )
        )
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert outs[1].shape == (1, t, heads, d)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


# --- end to end ----------------------------------------------------------------------------------


# max_batch_tokens=16 chunks the prompts, so steps mix decode rows with prefill chunks
@pytest.mark.parametrize("arch,max_batch_tokens", [("llama", None), ("llama", 16), ("mistral", 16)])
def test_generate_batch_matches_torch_backend(arch, max_batch_tokens):
    model = tiny_model(arch).to(DEVICE)  # mistral: sliding_window=24
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 5, 17, 41)]
    results = {}
    for backend in ("torch", "triton"):
        cfg = acb.ContinuousBatchingConfig(
            page_size=8, num_blocks=128, attn_backend=backend, max_batch_tokens=max_batch_tokens
        )
        out = acb.generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=6, progress_bar=False)
        results[backend] = [o.generated_tokens for o in out.values()]
    assert all(len(toks) == 6 for toks in results["torch"])
    assert results["triton"] == results["torch"]


def test_backend_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    from acb.runner.attention import triton_backend

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert check_backend(TritonBackend(), dev, torch.float32, head_dim=32, block_size=8) is None
    monkeypatch.setattr(
        triton_backend.tk, "paged_decode_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken"))
    )
    assert "broken" in check_backend(TritonBackend(), dev, torch.float32, head_dim=32, block_size=8)
