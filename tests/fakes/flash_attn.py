"""A slow, pure-torch stand-in for the two flash-attn functions acb calls, written from their
documented semantics (flash-attn 2.6+ ``flash_attn_interface`` docstrings): paged K/V
``[num_blocks, page_block_size, kv_heads, head_dim]`` with ``page_block_size % 256 == 0``,
int32 ``block_table`` / ``cu_seqlens`` / ``cache_seqlens``, GQA by head groups, causal aligned
bottom-right, ``window_size=(left, right)`` with key j visible to query i when
``i + Lk - Lq - left <= j <= i + Lk - Lq + right``, and ``softcap`` applied as
``softcap * tanh(scores / softcap)``. It checks those input contracts, so a test that passes
here passes acb's calls through the same conventions the real kernels expect."""

from __future__ import annotations

import torch

calls = {"varlen": 0, "kvcache": 0}


def _check_paged(k_cache, v_cache, block_table):
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "paged K/V must be [blocks, page, kv_heads, dim]"
    assert k_cache.shape[1] % 256 == 0, "page_block_size must be a multiple of 256"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_table.dtype == torch.int32 and block_table.dim() == 2


def _attend(q, k, v, scale, window, softcap, lse_out=None):
    """q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H, D], causal bottom-right; ``lse_out`` ([H, Lq]) gets
    each row's log-sum-exp of the (scaled, soft-capped, masked) scores."""
    lq, heads, d = q.shape
    lk, hkv, _ = k.shape
    k = k.repeat_interleave(heads // hkv, dim=1).float()
    v = v.repeat_interleave(heads // hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * (scale if scale is not None else d**-0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    keep = j <= i
    left, right = window
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    if lse_out is not None:
        lse_out.copy_(torch.logsumexp(s, dim=-1))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with nothing visible gives zeros
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


def _gather(cache, table_row, n):
    page = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[table_row[pos // page].long(), pos % page]  # [n, Hkv, D]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    calls["varlen"] += 1
    assert block_table is not None, "acb always passes the paged cache"
    _check_paged(k, v, block_table)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert causal and dropout_p == 0.0
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)  # [H, total_q]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert lq <= max_seqlen_q and lk <= max_seqlen_k
        if lq == 0:
            continue
        kb, vb = _gather(k, block_table[b], lk), _gather(v, block_table[b], lk)
        out[cq[b] : cq[b + 1]] = _attend(
            q[cq[b] : cq[b + 1]], kb, vb, softmax_scale, window_size, softcap, lse[:, cq[b] : cq[b + 1]]
        )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    calls["kvcache"] += 1
    assert k is None and v is None, "acb stores new K/V itself"
    _check_paged(k_cache, v_cache, block_table)
    assert cache_seqlens.dtype == torch.int32 and q.dim() == 4
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32)  # [B, H, Lq]
    for b, n in enumerate(cache_seqlens.tolist()):
        if n == 0:
            continue
        kb, vb = _gather(k_cache, block_table[b], n), _gather(v_cache, block_table[b], n)
        out[b] = _attend(q[b], kb, vb, softmax_scale, window_size, softcap, lse[b])
    return (out, lse) if return_softmax_lse else out
