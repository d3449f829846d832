"""Triton kernels for the paged KV cache: store new K/V, decode attention, varlen prefill attention.

Cache layout (see ``acb.runner.kv_cache``): per layer K and V each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a sequence lives in block
``block_table[seq, p // block_size]`` at offset ``p % block_size`` (flat slot
``block * block_size + offset``). Every tensor is passed with explicit strides, so query/key views
(e.g. ``query[0].transpose(0, 1)``) need no copy.

All arithmetic accumulates in fp32. On a GPU, fp16/bf16 operands go to ``tl.dot`` natively (fp32
accumulators); fp32 operands use IEEE precision (no TF32), to match torch. Under the Triton
interpreter (``TRITON_INTERPRET=1``) every operand is upcast to fp32 first, because the
interpreter's low-precision ``tl.dot`` is wrong for bf16.

Kernels
-------
* ``store_kv``: one program per new token, a ``[heads, head_dim]`` tile; slot < 0 skips the row.
* ``paged_decode_attention``: one query token per sequence. A program owns one (sequence, KV head,
  split): the query heads of the KV head's GQA group are packed into the rows of one tile (so K/V
  are read once per group), and the context (or, with a sliding window, only its last
  ``window`` positions) is cut into ``num_splits`` contiguous partitions. Each split writes an
  unnormalised accumulator with its running max and sum; a reduction kernel rescales and combines
  them (flash-decoding). With one split the kernel writes the normalised output directly.
* ``paged_prefill_attention``: varlen (chunked) prefill. A program owns ``BLOCK_M`` queries of
  one (sequence, head) and walks the key tiles it can see (causal, bottom-right aligned; only the
  window with a sliding window) with an online softmax.
* ``paged_latent_attention``: an MLA layer's latent pages (``[num_blocks, block_size, 1, r + rope]``,
  ``acb.runner.latent``) with the query absorbed (B3): one KV head for all ``H`` query heads, whose
  keys are the whole ``[c | k_rot]`` row and whose values are its first ``r`` columns. One query per
  program row, each with its own context length and block-table row (decode rows, and each query of
  a short chunk after a cached prefix); split-K with the decode kernel's reduction.

Both attention kernels take attention sinks (GPT-OSS: a per-head logit in the softmax's
denominator with no value; the online softmax starts from it, in the decode kernel's first split
only) and chunked attention (Llama 4: a query at position ``p`` sees keys ``j`` with
``j // chunk == p // chunk``; the key loop starts at the chunk).

Both attention kernels can also take the whole flattened step (``query_start_loc``): the decode
kernel then serves only the sequences with exactly one query and the prefill kernel
(``skip_decode=True``) only the others, both writing into one output. This needs no gather of
the query rows and no host sync.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_latent_attention",
    "choose_num_splits",
    "interpreted",
    "precompile",
    "precompile_latent",
]

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256


@functools.cache
def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_store_kv_kernel, InterpretedFunction)


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, int(n))))


def _upcast(*tensors: torch.Tensor) -> bool:
    """fp32 operands in the kernel's dots: always under the interpreter, and for fp32 caches."""
    return interpreted() or any(t.dtype == torch.float32 for t in tensors)


def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.stride(0) != 1):
        raise ValueError(
            f"sinks must be a contiguous [{num_heads}] tensor (one logit per query head), got {tuple(sinks.shape)}"
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# shared device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """``a @ b`` with an fp32 result; ``F32``: upcast both operands and use IEEE fp32 precision."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1: saturates cleanly at +-1 for large |x|
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    pos,
    p_mask,
    d,
    d_mask,
    kvh,
    block_size,
    stride_btc,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
):
    """K and V ``[N, D]`` of one KV head at context positions ``pos`` (masked rows are zeros),
    through the sequence's block-table row ``bt_row``."""
    blk = tl.load(bt_row + (pos // block_size) * stride_btc, mask=p_mask, other=0).to(tl.int64)
    off = pos % block_size
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache_ptr
        + blk[:, None] * stride_kcb
        + off[:, None] * stride_kco
        + kvh * stride_kch
        + d[None, :] * stride_kcd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr
        + blk[:, None] * stride_vcb
        + off[:, None] * stride_vco
        + kvh * stride_vch
        + d[None, :] * stride_vcd,
        mask=kv_mask,
        other=0.0,
    )
    return k, v


@triton.jit
def _scaled(s, scale_log2, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw scores ``s`` scaled (and soft-capped) in base 2: ready for ``exp2``."""
    if HAS_SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * scale_log2
    return s


@triton.jit
def _scores(q, k, scale_log2, scale, softcap, HAS_SOFTCAP: tl.constexpr, F32: tl.constexpr):
    """``q @ k.T`` scaled (and soft-capped) in base 2: ready for ``exp2``."""
    return _scaled(_dot(q, tl.trans(k), F32), scale_log2, scale, softcap, HAS_SOFTCAP)


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, F32: tl.constexpr):
    """One online-softmax update with a tile of masked scores ``s`` [R, N] and values ``v`` [N, D]:
    the new running max, sum and unnormalised accumulator (rows with nothing visible stay 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32:
        pv = _dot(p, v, F32)
    else:
        pv = _dot(p.to(v.dtype), v, F32)
    return m_new, l_i, acc * alpha[:, None] + pv


# ---------------------------------------------------------------------------------------------
# (a) store new K/V into the paged cache
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < num_heads)[:, None] & (d < head_dim)[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kco + h[:, None] * stride_kch + d[None, :] * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vco + h[:, None] * stride_vch + d[None, :] * stride_vcd
    tl.store(kc, k.to(kc.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; < 0 = skip the row
) -> None:
    """Write ``key``/``value`` row ``t`` into flat cache slot ``slot_mapping[t]`` (skipped when < 0)."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape or tuple(k_cache.shape[2:]) != (num_heads, head_dim):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the cache {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        head_dim,
        k_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=_pow2(num_heads),
        BLOCK_D=_pow2(head_dim),
    )


# ---------------------------------------------------------------------------------------------
# (b) decode: one query per sequence, split-K over the context, then a reduction
# ---------------------------------------------------------------------------------------------


# ``stride_btb`` is the gathered block table's width, which follows each step's longest context:
# left to Triton's integer specialisation (== 1, % 16 == 0) it would recompile mid-serving
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    scale_log2,
    scale,
    softcap,
    window,
    chunk,
    num_splits,
    group,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    stride_btb,
    stride_btc,
    stride_ot,
    stride_oh,
    stride_od,
    HAS_QSL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    F32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_QSL:
        row = tl.load(qsl_ptr + seq).to(tl.int64)
        n_q = tl.load(qsl_ptr + seq + 1) - row
        if n_q != 1:
            return  # a prefill chunk: served by the prefill kernel
    else:
        row = seq
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    # this split's part of the visible context [lo, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if HAS_CHUNK:  # the query (position seq_len - 1) sees its own chunk only
        lo = tl.maximum(lo, (tl.maximum(seq_len, 1) - 1) // chunk * chunk)
    span = seq_len - lo
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink joins the softmax once, as a key of score `sink` and value 0
            m_i = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            pos,
            p_mask,
            d,
            d_mask,
            kvh,
            block_size,
            stride_btc,
            stride_kcb,
            stride_kco,
            stride_kch,
            stride_kcd,
            stride_vcb,
            stride_vco,
            stride_vch,
            stride_vcd,
        )
        s = _scores(q, k, scale_log2, scale, softcap, HAS_SOFTCAP, F32)  # [G, N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, F32)

    if SINGLE_SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptr = out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # partials: [B, H, S] max/sum and [B, H, S, BLOCK_D] accumulators, contiguous
        num_heads = tl.num_programs(1) * group
        hs = (seq * num_heads + heads) * num_splits + split  # [G]
        tl.store(part_m_ptr + hs, m_i, mask=g_mask)
        tl.store(part_l_ptr + hs, l_i, mask=g_mask)
        tl.store(part_acc_ptr + hs[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qsl_ptr,
    num_splits,
    head_dim,
    stride_ot,
    stride_oh,
    stride_od,
    HAS_QSL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if HAS_QSL:
        row = tl.load(qsl_ptr + seq).to(tl.int64)
        n_q = tl.load(qsl_ptr + seq + 1) - row
        if n_q != 1:
            return
    else:
        row = seq
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    base = (seq * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + base + s, mask=s_mask, other=0.0)  # noqa: E741 (the softmax sum, as in the papers)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, 0)
    num = tl.sum(w[:, None] * acc, 0)
    o = num / tl.where(denom > 0.0, denom, 1.0)  # seq_len 0: zeros
    tl.store(
        out_ptr + row * stride_ot + h * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty), mask=d < head_dim
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None) -> int:
    """Context partitions for decode: enough programs to fill the GPU, >= 256 tokens a split, <= 32.

    Short contexts or a large batch (``num_seqs * num_kv_heads`` programs already fill the
    machine) use one split, i.e. no reduction pass.
    """
    by_len = -(-max(int(max_seq_len), 1) // MIN_TOKENS_PER_SPLIT)
    if by_len <= 1:
        return 1
    if device is not None and device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 64
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = -(-target // programs)
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def _decode_block_n(head_dim_block: int) -> int:
    return 32 if head_dim_block >= 256 else 64


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] (or [T, H, D] with query_start_loc)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int: context length including the query token
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    query_start_loc: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns ``[B, H, D]``.

    ``sinks`` ([H], attention sinks as GPT-OSS's): one more logit per head in the softmax's
    denominator, with no value. ``chunk`` (chunked attention, Llama 4): the query at position
    ``p`` sees only keys ``j`` with ``j // chunk == p // chunk``.

    ``num_splits=None`` picks a split count from ``max_seq_len`` (host int; when not given it is
    read from ``seq_lens``, a device sync). With ``query_start_loc`` ([B + 1]), ``q``/``out`` are
    the whole flattened step ``[T, H, D]``: sequence ``b``'s query is row ``query_start_loc[b]``
    and only sequences with exactly one query are computed (other rows of ``out`` are untouched).
    Sequences with ``seq_len == 0`` produce zeros.
    """
    _check_cache(k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = (
            torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if query_start_loc is not None
            else torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
        )
    if num_seqs == 0:
        return out
    if scale is None:
        scale = head_dim**-0.5
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        eff = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        eff = min(eff, chunk) if chunk else eff
        num_splits = choose_num_splits(num_seqs, num_kv_heads, eff, q.device)
    num_splits = max(1, int(num_splits))
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim, 16)
    single = num_splits == 1
    if single:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    qsl = query_start_loc if query_start_loc is not None else seq_lens  # placeholder when unused
    _check_sinks(sinks, num_heads)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        qsl,
        out,
        part_acc,
        part_m,
        part_l,
        sinks if sinks is not None else seq_lens,
        float(scale) * _LOG2E,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        int(chunk or 1),
        num_splits,
        group,
        head_dim,
        block_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_table.stride(),
        *out.stride(),
        HAS_QSL=query_start_loc is not None,
        HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=bool(chunk),
        SINGLE_SPLIT=single,
        F32=_upcast(q, k_cache),
        BLOCK_G=_pow2(group, 16),
        BLOCK_N=_decode_block_n(block_d),
        BLOCK_D=block_d,
        num_warps=4,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            qsl,
            num_splits,
            head_dim,
            *out.stride(),
            # one width for every split count up to MAX_SPLITS: one compiled variant
            HAS_QSL=query_start_loc is not None,
            BLOCK_S=_pow2(num_splits, MAX_SPLITS),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# (c) varlen / chunked prefill over the paged cache
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    sinks_ptr,
    scale_log2,
    scale,
    softcap,
    window,
    chunk,
    group,
    head_dim,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    stride_btb,
    stride_btc,
    stride_ot,
    stride_oh,
    stride_od,
    SKIP_DECODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = (tl.load(qsl_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:
            return  # served by the decode kernel
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    kvh = h // group

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < q_len
    q_pos = seq_len - q_len + i  # bottom-right aligned causal positions
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + (q_start + i)[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
        mask=i_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    first_pos = seq_len - q_len + tile * BLOCK_M
    hi = seq_len - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len)  # last visible key + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_CHUNK:  # the tile's first query's chunk start: no query of the tile sees a key before it
        lo = tl.maximum(lo, first_pos // chunk * chunk)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink joins the softmax as a key of score `sink` and value 0
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_table_ptr + seq * stride_btb
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            pos,
            p_mask,
            d,
            d_mask,
            kvh,
            block_size,
            stride_btc,
            stride_kcb,
            stride_kco,
            stride_kch,
            stride_kcd,
            stride_vcb,
            stride_vco,
            stride_vch,
            stride_vcd,
        )
        s = _scores(q, k, scale_log2, scale, softcap, HAS_SOFTCAP, F32)  # [M, N]
        visible = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if HAS_CHUNK:
            visible = visible & (pos[None, :] >= (q_pos // chunk * chunk)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, F32)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + i)[:, None] * stride_ot + h * stride_oh + d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=i_mask[:, None] & d_mask[None, :],
    )


def _prefill_blocks(head_dim_block: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the prefill kernel."""
    if head_dim_block >= 256:
        return 64, 32, 8
    if head_dim_block >= 128:
        return 64, 64, 4
    return 64, 64, 4


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int: context length after this step (includes the queries)
    max_q_len: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    skip_decode: bool = False,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its whole paged context; returns ``[T, H, D]``.

    ``sinks`` and ``chunk`` as in :func:`paged_decode_attention`.

    Query ``i`` of a sequence with ``q_len`` queries and context ``L`` sits at position
    ``L - q_len + i`` and sees keys ``0..L - q_len + i`` (those within the sliding window when
    one is given: key ``j`` is visible iff ``j > pos - window``). The K/V of the queries must
    already be in the cache. ``skip_decode``: sequences with one query are left to the decode
    kernel (their rows of ``out`` are untouched).
    """
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_q_len <= 0:
        return out
    if scale is None:
        scale = head_dim**-0.5
    block_d = _pow2(head_dim, 16)
    block_m, block_n, warps = _prefill_blocks(block_d)  # not cut to max_q_len: one compiled variant
    _check_sinks(sinks, num_heads)
    grid = (triton.cdiv(max_q_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        out,
        sinks if sinks is not None else seq_lens,
        float(scale) * _LOG2E,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        int(chunk or 1),
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_table.stride(),
        *out.stride(),
        SKIP_DECODE=skip_decode,
        HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=bool(chunk),
        F32=_upcast(q, k_cache),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# (d) an MLA layer's latent pages, the query absorbed (B3 of acb.runner.latent)
# ---------------------------------------------------------------------------------------------


# the block table's width and the split count vary per step (see _decode_split_kernel)
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _latent_decode_kernel(
    q_ptr,
    pages_ptr,
    block_table_ptr,
    rows_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    scale_log2,
    scale,
    softcap,
    window,
    chunk,
    num_splits,
    num_heads,
    rank,
    rope,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_pb,
    stride_po,
    stride_pd,
    stride_btb,
    stride_btc,
    stride_ot,
    stride_oh,
    stride_od,
    HAS_ROWS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    F32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # the query
    hb = tl.program_id(1)  # its block of heads
    split = tl.program_id(2)
    if HAS_ROWS:
        bt = tl.load(rows_ptr + i).to(tl.int64)
    else:
        bt = i
    seq_len = tl.load(seq_lens_ptr + i).to(tl.int32)

    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if HAS_CHUNK:  # the query (position seq_len - 1) sees its own chunk only
        lo = tl.maximum(lo, (tl.maximum(seq_len, 1) - 1) // chunk * chunk)
    span = seq_len - lo
    part = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, seq_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    c = tl.arange(0, BLOCK_R)  # the latent's first rank columns: keys and values
    c_mask = c < rank
    r = rank + tl.arange(0, BLOCK_P)  # its rope columns: keys only
    r_mask = r < rank + rope
    q_row = q_ptr + i * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :] * stride_qd, mask=h_mask[:, None] & c_mask[None, :], other=0.0)
    q_r = tl.load(q_row + r[None, :] * stride_qd, mask=h_mask[:, None] & r_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink joins the softmax once, as a key of score `sink` and value 0
            m_i = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_row = block_table_ptr + bt * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        blk = tl.load(bt_row + (pos // block_size) * stride_btc, mask=p_mask, other=0).to(tl.int64)
        page = pages_ptr + blk[:, None] * stride_pb + (pos % block_size)[:, None] * stride_po
        k_c = tl.load(page + c[None, :] * stride_pd, mask=p_mask[:, None] & c_mask[None, :], other=0.0)  # [N, R]
        k_r = tl.load(page + r[None, :] * stride_pd, mask=p_mask[:, None] & r_mask[None, :], other=0.0)  # [N, P]
        s = _dot(q_c, tl.trans(k_c), F32) + _dot(q_r, tl.trans(k_r), F32)  # [H, N]
        s = _scaled(s, scale_log2, scale, softcap, HAS_SOFTCAP)
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, k_c, m_i, l_i, acc, F32)  # the values: the same rank columns

    if SINGLE_SPLIT:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptr = out_ptr + i * stride_ot + heads[:, None] * stride_oh + c[None, :] * stride_od
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])
    else:
        # partials: [N, H, S] max/sum and [N, H, S, BLOCK_R] accumulators (_decode_reduce_kernel's layout)
        hs = (i * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + hs, m_i, mask=h_mask)
        tl.store(part_l_ptr + hs, l_i, mask=h_mask)
        tl.store(part_acc_ptr + hs[:, None] * BLOCK_R + c[None, :], acc, mask=h_mask[:, None])


LATENT_BLOCK_H = 16  # query heads per program (tl.dot's smallest M on a GPU)


def _latent_blocks(rank_block: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for the latent kernel: a 512-wide latent tile of 32 keys is 32 KiB in bf16."""
    return (32, 4) if rank_block >= 256 else (64, 4)


def paged_latent_attention(
    q: torch.Tensor,  # [N, H, rank + rope]: absorbed queries ([q_nope . W_UK | q_rot]), one row per query
    pages: torch.Tensor,  # [num_blocks, block_size, 1, rank + rope]: the latent [c | k_rot]
    block_table: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [N] int: the keys query i sees (its position + 1)
    rank: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    *,
    rows: torch.Tensor | None = None,  # [N] int: query i's block-table row; None: row i
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [N, H, >= rank]: the first rank columns are written
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of absorbed MLA queries over an MLA layer's paged latent (B3 of :mod:`acb.runner.latent`);
    returns ``[N, H, rank]``, the attention-weighted latent ``c`` (``unabsorb`` makes it the heads' values).

    The latent is one KV head for all ``H`` query heads (GQA with ``G = H``): its keys are the whole
    ``[c | k_rot]`` row, its values the first ``rank`` columns ``c``. A program owns one query, a block of
    ``LATENT_BLOCK_H`` heads and one split of the context; each key tile is read once, as ``c`` (a
    power-of-two block, masked) and ``k_rot`` (another), and ``c`` serves both products. Each query has
    its own context length and block-table row, so a decode row and each query of a short chunk after a
    cached prefix (its position ``start + j``, the chunk's causal mask) are rows alike. ``scale``,
    ``sliding_window``, ``softcap``, ``sinks`` ([H]), ``chunk``, ``num_splits`` and ``max_seq_len`` as in
    :func:`paged_decode_attention`. Queries with ``seq_len == 0`` produce zeros."""
    if pages.dim() != 4 or pages.shape[2] != 1:
        raise ValueError(f"latent pages must be [num_blocks, block_size, 1, rank + rope], got {tuple(pages.shape)}")
    num_q, num_heads, width = q.shape
    _, block_size, _, cache_dim = pages.shape
    rope = width - rank
    if cache_dim != width or not 0 < rank <= width:
        raise ValueError(f"query {tuple(q.shape)} with rank {rank} does not fit the latent pages {tuple(pages.shape)}")
    if seq_lens.shape != (num_q,) or (rows is not None and rows.shape != (num_q,)):
        raise ValueError(f"seq_lens and rows must be [{num_q}] (one per query)")
    if out is None:
        out = torch.empty((num_q, num_heads, rank), dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    if scale is None:
        scale = width**-0.5
    head_blocks = triton.cdiv(num_heads, LATENT_BLOCK_H)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        eff = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
        eff = min(eff, chunk) if chunk else eff
        num_splits = choose_num_splits(num_q, head_blocks, eff, q.device)
    num_splits = max(1, int(num_splits))
    block_r = _pow2(rank, 16)
    block_n, warps = _latent_blocks(block_r)
    single = num_splits == 1
    if single:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = torch.empty((num_q, num_heads, num_splits, block_r), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_q, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    _check_sinks(sinks, num_heads)
    _latent_decode_kernel[(num_q, head_blocks, num_splits)](
        q,
        pages,
        block_table,
        rows if rows is not None else seq_lens,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        sinks if sinks is not None else seq_lens,
        float(scale) * _LOG2E,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        int(chunk or 1),
        num_splits,
        num_heads,
        rank,
        rope,
        block_size,
        *q.stride(),
        pages.stride(0),
        pages.stride(1),
        pages.stride(3),
        *block_table.stride(),
        *out.stride(),
        HAS_ROWS=rows is not None,
        HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        HAS_CHUNK=bool(chunk),
        SINGLE_SPLIT=single,
        F32=_upcast(q, pages),
        BLOCK_H=LATENT_BLOCK_H,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=_pow2(rope, 16),
        num_warps=warps,
    )
    if not single:
        _decode_reduce_kernel[(num_q, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            seq_lens,  # (no query_start_loc)
            num_splits,
            rank,
            *out.stride(),
            HAS_QSL=False,
            BLOCK_S=_pow2(num_splits, MAX_SPLITS),
            BLOCK_D=block_r,
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# warm-up: every specialisation the engine launches, compiled before the first real step
# ---------------------------------------------------------------------------------------------


def precompile(
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dtype: torch.dtype,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """Launch every kernel variant a layer with these settings can need, on a few dummy rows, so
    that Triton compiles them all now rather than in the middle of serving (each compile stalls
    the engine thread for about a second; the disk cache makes later processes fast).

    The variants: the K/V store; decode with one split and with a reduction, each alone and
    beside prefill rows (``query_start_loc``); prefill alone and beside decode rows. Nothing is
    written (every slot is -1) and only block 0, the scratch block, is read. Every integer that
    varies between steps is either ``do_not_specialize`` or fixed per model, so these are the
    same specialisations as the engine's launches (``tests/runner/test_kernel_compile.py``
    checks this against a sweep of step shapes)."""
    device = k_cache.device
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    long: dict[str, Any] = dict(dtype=torch.long, device=device)
    kv = torch.zeros(3, num_kv_heads, head_dim, dtype=dtype, device=device)
    store_kv(kv, kv, k_cache, v_cache, torch.full((3,), -1, **long))
    table = torch.zeros(2, 2, **long)
    q = torch.zeros(3, num_heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    lens = torch.tensor([2, 2], **long)
    for splits in (1, 2):  # one split, and split-K with the reduction pass
        paged_decode_attention(
            q, k_cache, v_cache, table, lens, scale, sliding_window, softcap, splits, out=out, sinks=sinks, chunk=chunk
        )
        paged_decode_attention(
            q,
            k_cache,
            v_cache,
            table,
            lens,
            scale,
            sliding_window,
            softcap,
            splits,
            query_start_loc=torch.tensor([0, 1, 3], **long),
            out=out,
            sinks=sinks,
            chunk=chunk,
        )
    for skip_decode, qsl in ((True, [0, 1, 3]), (False, [0, 2, 3])):
        paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            table,
            torch.tensor(qsl, **long),
            lens,
            2,
            scale,
            sliding_window,
            softcap,
            skip_decode=skip_decode,
            out=out,
            sinks=sinks,
            chunk=chunk,
        )


def precompile_latent(
    num_heads: int,
    pages: torch.Tensor,
    rank: int,
    dtype: torch.dtype,
    scale: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """:func:`precompile` for an MLA layer's latent pages: the latent kernel with one split and with a
    reduction, for a decode-only step (no rows) and beside other rows (``rows``). Only block 0 is read."""
    device = pages.device
    long: dict[str, Any] = dict(dtype=torch.long, device=device)
    table = torch.zeros(2, 2, **long)
    q = torch.zeros(2, num_heads, pages.shape[3], dtype=dtype, device=device)
    lens = torch.tensor([2, 2], **long)
    for splits in (1, 2):
        for rows in (None, torch.tensor([1, 0], **long)):
            paged_latent_attention(
                q, pages, table, lens, rank, scale, sliding_window, softcap, splits, rows=rows, sinks=sinks, chunk=chunk
            )
