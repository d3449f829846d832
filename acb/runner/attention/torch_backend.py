"""The reference attention backend: gather each sequence's pages and run SDPA.

Decode rows (one query token) of a step are batched into one padded SDPA call per layer;
prefill chunks run one SDPA call each. Causal masks are aligned bottom-right (a chunk's
queries sit at the end of its context). Masks and gather indices are built once per step
and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from acb.runner.attention import BatchInputs, StepContext


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    ctx_len: int  # keys visible to the last query (= start + q_len)
    gather: torch.Tensor | None  # [ctx_len] flat slots; None when the chunk is the whole context


@dataclass
class TorchMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_tokens: int
    decode_rows: torch.Tensor | None  # [Bd] token index of each decode query
    decode_gather: torch.Tensor | None  # [Bd, Lmax] flat slots (padded with slot 0)
    decode_seq_lens: torch.Tensor | None  # [Bd]
    prefills: list[_Prefill]
    _masks: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)


class TorchBackend:
    name = "torch"
    supports_graphs = False  # gathers are sized from host lengths

    def build_metadata(self, batch: BatchInputs, block_size: int) -> TorchMetadata:
        dec = [i for i, n in enumerate(batch.num_new) if n == 1]
        device = batch.slot_mapping.device
        decode_rows = decode_gather = decode_lens = None
        if dec:
            idx = torch.tensor(dec, dtype=torch.long, device=device)
            decode_rows = batch.query_start_loc[idx]
            decode_lens = batch.seq_lens[idx]
            lmax = int(max(batch.start_pos[i] for i in dec)) + 1
            pos = torch.arange(lmax, device=device)
            bt = batch.block_table[idx]  # [Bd, max_blocks]
            nb = -(-lmax // block_size)
            decode_gather = (bt[:, :nb].repeat_interleave(block_size, dim=1)[:, :lmax] * block_size) + (pos % block_size)
        prefills = []
        qsl = [0]  # host copy of query_start_loc (no device read)
        for n in batch.num_new:
            qsl.append(qsl[-1] + n)
        for i, n in enumerate(batch.num_new):
            if n == 1:
                continue
            start = batch.start_pos[i]
            ctx_len = start + n
            gather = None
            if start > 0:
                pos = torch.arange(ctx_len, device=device)
                bt = batch.block_table[i]
                gather = bt[pos // block_size] * block_size + pos % block_size
            prefills.append(_Prefill(qsl[i], n, ctx_len, gather))
        return TorchMetadata(
            slot_mapping=batch.slot_mapping,
            num_tokens=batch.slot_mapping.numel(),
            decode_rows=decode_rows,
            decode_gather=decode_gather,
            decode_seq_lens=decode_lens,
            prefills=prefills,
        )

    # masks ----------------------------------------------------------------
    def _decode_mask(self, md: TorchMetadata, window: int | None) -> torch.Tensor:
        key = ("d", window)
        m = md._masks.get(key)
        if m is None:
            gather, seq_lens = md.decode_gather, md.decode_seq_lens
            assert gather is not None and seq_lens is not None  # called for decode rows only
            lmax = gather.shape[1]
            pos = torch.arange(lmax, device=gather.device)[None, :]
            lens = seq_lens[:, None]
            m = pos < lens
            if window is not None:
                m &= pos > (lens - 1 - window)
            m = m[:, None, None, :]  # [Bd, 1, 1, Lmax]
            md._masks[key] = m
        return m

    def _prefill_mask(self, md: TorchMetadata, k: int, p: _Prefill, window: int | None) -> torch.Tensor | None:
        if p.gather is None and window is None:
            return None  # plain causal over the chunk: SDPA's is_causal
        key = ("p", k, window)
        m = md._masks.get(key)
        if m is None:
            device = md.slot_mapping.device
            qpos = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=device)[:, None]
            kpos = torch.arange(p.ctx_len, device=device)[None, :]
            m = kpos <= qpos
            if window is not None:
                m &= kpos > qpos - window
            md._masks[key] = m
        return m

    # forward --------------------------------------------------------------
    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        ctx: StepContext,
        *,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        md: TorchMetadata = ctx.metadata
        cache = ctx.kv_cache
        k_flat, v_flat = cache.flat_k(layer), cache.flat_v(layer)
        k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
        v_new = value[0].transpose(0, 1)
        k_flat.index_copy_(0, md.slot_mapping, k_new.to(k_flat.dtype))
        v_flat.index_copy_(0, md.slot_mapping, v_new.to(v_flat.dtype))

        q = query[0]  # [H, T, D]
        out = query.new_empty(md.num_tokens, q.shape[0], q.shape[2])  # [T, H, D]
        if md.decode_rows is not None:
            qd = q[:, md.decode_rows, :].transpose(0, 1).unsqueeze(2)  # [Bd, H, 1, D]
            kd = k_flat[md.decode_gather].transpose(1, 2)  # [Bd, Hkv, Lmax, D]
            vd = v_flat[md.decode_gather].transpose(1, 2)
            o = _attend(qd, kd, vd, self._decode_mask(md, sliding_window), False, scaling, softcap)
            out[md.decode_rows] = o[:, :, 0, :]
        for k, p in enumerate(md.prefills):
            s, n = p.q_start, p.q_len
            qp = q[:, s : s + n, :].unsqueeze(0)  # [1, H, n, D]
            if p.gather is None:
                kp = key[:, :, s : s + n, :]
                vp = value[:, :, s : s + n, :]
            else:
                kp = k_flat[p.gather].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
                vp = v_flat[p.gather].transpose(0, 1).unsqueeze(0)
            mask = self._prefill_mask(md, k, p, sliding_window)
            o = _attend(qp, kp, vp, mask, mask is None, scaling, softcap)
            out[s : s + n] = o[0].transpose(0, 1)
        return out.unsqueeze(0)  # [1, T, H, D]


def _attend(
    q: torch.Tensor,  # [B, H, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # bool, True = attend; broadcastable to [B, H, Lq, Lk]
    causal: bool,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
        )
    # logit soft-capping (Gemma 2) is not expressible in SDPA: explicit attention, as transformers' eager
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    w = torch.tanh(w / softcap) * softcap
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)
