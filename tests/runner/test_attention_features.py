"""Attention sinks and chunked attention in every backend: the Triton kernels (under the
interpreter on CPU, ``TRITON_INTERPRET=1``) against a plain reference, the Triton and flash-attn
(its pure-torch double) backends against the torch backend, KV-shared layers (no store), and the
engine with each backend against ``model.generate`` on GPT-OSS, Llama 4, Gemma 3n and the per-layer
page shapes of Gemma 4 and MiMo V2 Flash."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import acb  # noqa: E402
from acb.runner.attention import AttentionCall, BatchInputs, StepContext, flash_attn_backend  # noqa: E402
from acb.runner.attention import triton_kernels as tk  # noqa: E402
from acb.runner.attention.torch_backend import TorchBackend  # noqa: E402
from acb.runner.attention.triton_backend import TritonBackend  # noqa: E402
from acb.runner.kv_cache import KVCache, KVSpec  # noqa: E402
from tests.api.test_model_features import feature_model  # noqa: E402
from tests.conftest import prompts_of_lengths, reference_generate, triton_test_device  # noqa: E402
from tests.fakes import flash_attn as fake  # noqa: E402
from tests.runner.test_triton_kernels import assert_close, make_block_table, make_cache  # noqa: E402

DEVICE = triton_test_device()
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")] + (
    [pytest.mark.gpu] if DEVICE.type == "cuda" else []
)


def ref_attention(q, k_cache, v_cache, block_table, q_lens, seq_lens, scale, window=None, sinks=None, chunk=None):
    """fp32 reference with sinks (an extra softmax column per head, no value) and chunks."""
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // kv_heads
    kf = k_cache.float().reshape(-1, kv_heads, head_dim)
    vf = v_cache.float().reshape(-1, kv_heads, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    t = 0
    for b, (n, L) in enumerate(zip(q_lens, seq_lens)):
        if L == 0:
            t += n
            continue
        pos = torch.arange(L, device=q.device)
        slots = block_table[b][pos // block_size] * block_size + pos % block_size
        k = kf[slots].repeat_interleave(group, dim=1)
        v = vf[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[t : t + n].float(), k) * scale
        qpos = (L - n + torch.arange(n, device=q.device))[:, None]
        vis = pos[None, :] <= qpos
        if window:
            vis &= pos[None, :] > qpos - window
        if chunk:
            vis &= pos[None, :] >= qpos // chunk * chunk
        s = s.masked_fill(~vis[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None, None].expand(-1, n, 1)], dim=-1)
            p = s.softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[t : t + n] = torch.einsum("hqk,khd->qhd", p, v)
        t += n
    return out


@pytest.mark.parametrize(
    "num_splits,sinks,chunk,window",
    [
        (1, True, None, None),
        (3, True, None, None),
        (1, False, 16, None),
        (3, True, 16, None),
        (2, True, 24, 9),
    ],
)
def test_decode_kernel_sinks_and_chunks(num_splits, sinks, chunk, window):
    hkv, group, d, bs = 2, 2, 16, 4
    heads = hkv * group
    seq_lens = [37, 1, 0, 16, 17, 90]  # a padded row, chunk boundaries (16, 17), several chunks
    nb = sum(-(-n // bs) for n in seq_lens) + 4
    k_cache, v_cache = make_cache(nb, bs, hkv, d, torch.float32, seed=21)
    bt = make_block_table(seq_lens, bs, nb, seed=21)
    q = torch.randn(len(seq_lens), heads, d, device=DEVICE)
    s = torch.randn(heads, device=DEVICE) * 2 if sinks else None
    lens = torch.tensor(seq_lens, dtype=torch.long, device=DEVICE)
    got = tk.paged_decode_attention(
        q, k_cache, v_cache, bt, lens, 0.3, window, None, num_splits, max_seq_len=max(seq_lens), sinks=s, chunk=chunk
    )
    want = ref_attention(q, k_cache, v_cache, bt, [1] * len(seq_lens), seq_lens, 0.3, window, s, chunk)
    assert_close(got, want, torch.float32)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # seq_len 0 -> zeros


@pytest.mark.parametrize(
    "dtype,sinks,chunk,window",
    [
        (torch.float32, True, None, None),
        (torch.float32, False, 8, None),
        (torch.float32, True, 8, 5),
        (torch.bfloat16, True, 16, None),
    ],
)
def test_prefill_kernel_sinks_and_chunks(dtype, sinks, chunk, window):
    hkv, group, d, bs = 2, 2, 16, 4
    heads = hkv * group
    q_lens = [7, 5, 1, 70, 3]  # full prefill, chunks after a prefix, one query, two query tiles
    seq_lens = [7, 12, 9, 75, 3]
    nb = sum(-(-n // bs) for n in seq_lens) + 4
    k_cache, v_cache = make_cache(nb, bs, hkv, d, dtype, seed=22)
    bt = make_block_table(seq_lens, bs, nb, seed=22)
    q = torch.randn(sum(q_lens), heads, d, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.long, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=DEVICE)
    s = torch.randn(heads, device=DEVICE) * 2 if sinks else None
    got = tk.paged_prefill_attention(
        q, k_cache, v_cache, bt, qsl, lens, max(q_lens), 0.3, window, None, sinks=s, chunk=chunk
    )
    want = ref_attention(q, k_cache, v_cache, bt, q_lens, seq_lens, 0.3, window, s, chunk)
    assert_close(got, want, dtype)


def _step(num_new, start_pos, bs, nb, seed):
    seq_lens = [s + n for s, n in zip(start_pos, num_new)]
    g = torch.Generator().manual_seed(seed)
    cols = max(-(-n // bs) for n in seq_lens)
    bt = (torch.randperm(nb - 1, generator=g) + 1)[: len(seq_lens) * cols].view(len(seq_lens), cols).to(DEVICE)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(start_pos, num_new)]).to(DEVICE)
    seq_of = torch.repeat_interleave(torch.arange(len(num_new), device=DEVICE), torch.tensor(num_new, device=DEVICE))
    slots = bt[seq_of, pos // bs] * bs + pos % bs
    qsl = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist(), dtype=torch.long, device=DEVICE)
    return BatchInputs(
        slot_mapping=slots,
        block_table=bt,
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        query_start_loc=qsl,
        num_new=num_new,
        start_pos=start_pos,
        max_seq_len=max(seq_lens),
    )


STEPS = [([1, 1, 1], [6, 40, 12]), ([1, 9, 1, 4, 1], [20, 0, 3, 11, 0]), ([12, 1, 5], [0, 33, 8])]


@pytest.mark.parametrize("backend_name", ["triton", "flash_attn"])
@pytest.mark.parametrize("num_new,start_pos", STEPS)
@pytest.mark.parametrize("sinks,chunk,store", [(True, None, True), (False, 8, True), (True, 8, False)])
def test_backend_matches_torch(monkeypatch, backend_name, num_new, start_pos, sinks, chunk, store):
    if backend_name == "flash_attn":
        monkeypatch.setitem(sys.modules, "flash_attn", fake)
        bs, make = 256, flash_attn_backend.FlashAttnBackend
    else:
        bs, make = 4, TritonBackend
    hkv, heads, d = 2, 4, 16
    nb = 1 + len(num_new) * max(-(-(s + n) // bs) for s, n in zip(start_pos, num_new))
    batch = _step(num_new, start_pos, bs, nb, seed=23)
    spec = KVSpec.uniform(1, hkv, d, torch.float32)
    k0, v0 = make_cache(nb, bs, hkv, d, torch.float32, seed=24)
    caches = [KVCache(spec, nb, bs, DEVICE) for _ in range(2)]
    for c in caches:
        c.k[0].copy_(k0)
        c.v[0].copy_(v0)
    t = batch.slot_mapping.numel()
    g = torch.Generator().manual_seed(25)
    query = torch.randn(1, t, heads, d, generator=g).to(DEVICE).transpose(1, 2)
    key = torch.randn(1, t, hkv, d, generator=g).to(DEVICE).transpose(1, 2)
    value = torch.randn(1, t, hkv, d, generator=g).to(DEVICE).transpose(1, 2)
    s = torch.randn(heads, generator=g).to(DEVICE) * 2 if sinks else None
    if not store:  # a KV-shared layer: its producer wrote the step's K/V into the cache layer already
        for c in caches:
            c.flat_k(0)[batch.slot_mapping] = key[0].transpose(0, 1)
            c.flat_v(0)[batch.slot_mapping] = value[0].transpose(0, 1)
        k0, v0 = caches[0].k[0].clone(), caches[0].v[0].clone()
    outs = []
    for backend, cache in zip((TorchBackend(), make()), caches):
        ctx = StepContext(cache, backend, backend.build_metadata(batch, bs))
        outs.append(
            backend.forward(
                0,
                query,
                key,
                value,
                ctx,
                AttentionCall(scaling=0.25, sinks=s, chunk=chunk, store=store),
            )
        )
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    if not store:  # a KV-shared layer writes nothing
        assert torch.equal(caches[1].k[0], k0) and torch.equal(caches[1].v[0], v0)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


# --- the engine on each backend against model.generate ------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text", "gemma3n_text", "gemma4_text", "mimo_v2_flash"])
def test_triton_engine_matches_generate(arch):
    model = feature_model(arch).to(DEVICE)
    prompts = prompts_of_lengths([17, 3, 26], seed=26)
    refs = [reference_generate(model, p, 4) for p in prompts]
    # 16-token steps: decode rows beside prefill chunks (the interpreter is slow: few tokens)
    cfg = acb.ContinuousBatchingConfig(page_size=8, num_blocks=32, attn_backend="triton", max_batch_tokens=16)
    res = acb.generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=4, progress_bar=False)
    assert [o.generated_tokens for o in res.values()] == refs


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the flash-attn double runs on CPU")
@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text", "gemma3n_text", "gemma4_text", "mimo_v2_flash"])
def test_flash_attn_engine_matches_generate(monkeypatch, arch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(flash_attn_backend, "unavailable_reason", lambda *a: None)
    model = feature_model(arch)
    prompts = prompts_of_lengths([19, 3, 30], seed=27)
    refs = [reference_generate(model, p, 5) for p in prompts]
    cfg = acb.ContinuousBatchingConfig(attn_backend="flash_attn", num_blocks=8, max_batch_tokens=16)
    res = acb.generate_batch(model, prompts, continuous_batching_config=cfg, max_new_tokens=5, progress_bar=False)
    assert [o.generated_tokens for o in res.values()] == refs
