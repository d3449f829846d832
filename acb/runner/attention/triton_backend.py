"""The Triton attention backend: paged kernels that read K/V straight from the block cache.

Per layer: one kernel writes the step's new K/V into the cache, then

* a decode-only step (every sequence has one query) runs the split-K decode kernel;
* any other step runs the prefill kernel for the sequences with more than one query and, when
  some have exactly one, the decode kernel for those, both over the whole flattened batch
  (each kernel skips the other's sequences; no gather, no host sync).

An MLA layer paged as its latent (``call.latent``, :mod:`acb.runner.latent`) stores the step's
latent into its key-only cache layer; its decode rows, and the queries of short chunks after a
cached prefix (``torch_backend.absorbs_chunk``), attend it absorbed (B3) through the latent kernel,
one launch (the module's ``LatentExpand`` absorbs the queries and unabsorbs the output); its other
chunks (B1) attend the gathered latent expanded by the module's own ``expand_kv``, laid out as pages
for the prefill kernel: ``model.generate``'s arithmetic, with every feature the prefill kernel takes.

Metadata is built once per step from host values (``num_new``, ``max_seq_len``) and shared by
every layer. Needs a CUDA device, or the Triton interpreter (``TRITON_INTERPRET=1``) on CPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from acb.runner.attention import AttentionCall, BatchInputs, StepContext
from acb.runner.attention import triton_kernels as tk
from acb.runner.attention.torch_backend import absorbs_chunk

if TYPE_CHECKING:
    from acb.runner.latent import LatentExpand


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] long
    block_table: torch.Tensor  # [B, cols] long
    seq_lens: torch.Tensor  # [B] long
    query_start_loc: torch.Tensor  # [B + 1] long
    num_tokens: int
    num_seqs: int
    num_decode: int  # sequences with exactly one query
    has_prefill: bool  # some sequence has more than one
    max_q_len: int
    max_decode_seq_len: int  # longest context among the decode sequences (0 when none)
    num_splits: int | None = None  # decode split count fixed by the caller (CUDA graphs); None: chosen per layer
    num_new: tuple[int, ...] = ()  # host: query tokens per sequence
    # the batch-invariant mode (TritonBackend.fixed_order) on a step with prefill: each query token's
    # block-table row [T, cols] and context length [T] (its position + 1), for the decode kernel
    per_query: tuple[torch.Tensor, torch.Tensor] | None = None
    start_pos: tuple[int, ...] = ()  # host: tokens already in the cache per sequence
    # an MLA latent's plans, built by the step's first latent layer, by the longest chunk absorbed
    latent_plans: dict[int, LatentPlan] = field(default_factory=dict)


@dataclass
class LatentPlan:
    """How a step's queries attend an MLA layer's latent pages: the absorbed ones (B3: decode rows,
    and short chunks after a cached prefix) as rows of the latent kernel, the others (B1) chunk by
    chunk over the expanded latent. Built on the device (no host sync, no copy from the host)."""

    count: int  # absorbed queries
    tokens: torch.Tensor | None  # [count] their token indices; None: every token, in order (decode rows only)
    rows: torch.Tensor | None  # [count] their block-table rows; None: token i on row i
    seq_lens: torch.Tensor  # [count] the keys each sees (its position + 1)
    max_len: int  # host: the longest of those
    expanded: list[tuple[int, int]]  # (sequence, its first token) of those attended expanded (B1)


def latent_plan(md: TritonMetadata, most: int) -> LatentPlan:
    """``md``'s plan when the chunks after a cached prefix of up to ``most`` queries, and the decode
    rows (for ``most >= 1``), are absorbed; made once per step and ``most``, shared by the layers."""
    plan = md.latent_plans.get(most)
    if plan is not None:
        return plan
    absorbed = [most >= 1 and (n == 1 or (s > 0 and n <= most)) for s, n in zip(md.start_pos, md.num_new)]
    firsts = [0, *itertools.accumulate(md.num_new)]  # each sequence's first token
    expanded = [(i, firsts[i]) for i, (a, n) in enumerate(zip(absorbed, md.num_new)) if n and not a]
    count = sum(n for a, n in zip(absorbed, md.num_new) if a)
    max_len = max((s + n for a, s, n in zip(absorbed, md.start_pos, md.num_new) if a), default=0)
    if count == md.num_tokens and not md.has_prefill:  # decode rows only: token i is sequence i's
        plan = LatentPlan(count, None, None, md.seq_lens, max_len, expanded)
    elif count == 0:
        plan = LatentPlan(0, None, None, md.seq_lens[:0], 0, expanded)
    else:
        qsl = md.query_start_loc.to(torch.long)
        lens = qsl[1:] - qsl[:-1]  # [B] queries per sequence
        start = md.seq_lens.to(torch.long) - lens
        takes = (lens == 1) | ((start > 0) & (lens <= most))  # `absorbed`, on the device
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=md.num_tokens)
        # the absorbed tokens in order: a stable sort puts them first (nonzero would sync)
        tokens = torch.argsort((~takes[seq]).to(torch.int8), stable=True)[:count]
        rows = seq[tokens]
        plan = LatentPlan(count, tokens, rows, start[rows] + (tokens - qsl[rows]) + 1, max_len, expanded)
    md.latent_plans[most] = plan
    return plan


def metadata_for(batch: BatchInputs) -> TritonMetadata:
    """A step's metadata: its device tensors plus the host values the launches are sized from."""
    dec_lens = [s + 1 for s, n in zip(batch.start_pos, batch.num_new) if n == 1]
    max_q_len = max(batch.num_new) if batch.num_new else 0
    return TritonMetadata(
        slot_mapping=batch.slot_mapping,
        block_table=batch.block_table,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        num_tokens=batch.slot_mapping.numel(),
        num_seqs=len(batch.num_new),
        num_decode=len(dec_lens),
        has_prefill=max_q_len > 1,
        max_q_len=max_q_len,
        max_decode_seq_len=max(dec_lens) if dec_lens else 0,
        num_new=tuple(batch.num_new),
        start_pos=tuple(batch.start_pos),
    )


class TritonBackend:
    name = "triton"
    features = frozenset({"sinks", "chunk", "latent"})
    supports_graphs = True  # decode reads every length from device tensors: only the split count is baked

    def __init__(self, fixed_order: bool = False) -> None:
        self._warmed: set[tuple] = set()  # layer settings whose kernel variants are compiled
        # the batch-invariant mode (acb.runner.batch_invariant): every query token, of a prefill
        # chunk or a decode row, through the decode kernel alone with one split, so its keys are
        # summed in position order in tiles from its window's start whatever the step holds
        self.fixed_order = fixed_order

    def graph_variants(self, num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> list[int]:
        """Decode split counts worth a graph at this padded batch size: one split (short contexts)
        and, when longer contexts would split, the count chosen for ``max_len``. Any count is
        correct for any length (empty splits weigh nothing), so a graph never computes stale
        results, only a suboptimal partition."""
        if self.fixed_order:
            return [1]
        return sorted({1, tk.choose_num_splits(num_seqs, num_kv_heads, max_len, device)})

    def graph_variant(
        self, variants: list[int], num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
    ) -> int:
        """The variant for a step whose longest context is ``max_seq_len`` (a host value)."""
        return variants[0] if tk.choose_num_splits(num_seqs, num_kv_heads, max_seq_len, device) == 1 else variants[-1]

    def graph_metadata(self, batch: BatchInputs, variant: int) -> TritonMetadata:
        """Metadata of a decode-only step captured in a graph (``batch`` holds one query per row):
        device tensors plus the split count ``variant``."""
        return replace(self.build_metadata(batch, 0), num_splits=variant)

    def build_metadata(self, batch: BatchInputs, block_size: int) -> TritonMetadata:
        device = batch.slot_mapping.device
        if device.type != "cuda" and not tk.interpreted():
            raise RuntimeError(
                f"the 'triton' attention backend needs a CUDA device (got {device}); "
                "on CPU set TRITON_INTERPRET=1 before importing triton, or use attn_backend='torch'"
            )
        return self.step_metadata(batch)

    def step_metadata(self, batch: BatchInputs) -> TritonMetadata:
        """:func:`metadata_for`, with each query's block-table row and length in the mode."""
        device = batch.slot_mapping.device
        md = metadata_for(batch)
        if self.fixed_order and md.has_prefill:
            qsl = batch.query_start_loc.to(torch.long)
            seq = torch.repeat_interleave(
                torch.arange(md.num_seqs, device=device), qsl[1:] - qsl[:-1], output_size=md.num_tokens
            )
            tok = torch.arange(md.num_tokens, device=device)
            # token t of sequence s sits at position seq_lens[s] - (qsl[s + 1] - t): it sees that + 1 keys
            lens = batch.seq_lens.to(torch.long)[seq] - qsl[seq + 1] + tok + 1
            md.per_query = (batch.block_table.index_select(0, seq), lens)
        return md

    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        ctx: StepContext,
        call: AttentionCall,
    ) -> torch.Tensor:
        if call.latent is not None:
            return self._latent(layer, query, key, ctx, call, call.latent)
        md: TritonMetadata = ctx.metadata
        cache = ctx.kv_cache
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        k_new = key[0].transpose(0, 1)  # [T, Hkv, D] (a view: strides go to the kernel)
        v_new = value[0].transpose(0, 1)
        q = query[0].transpose(0, 1)  # [T, H, D]
        scaling = call.scaling
        window = call.sliding_window if call.sliding_window else None
        cap = call.softcap if call.softcap else None
        chunk = call.chunk or None
        sinks = call.sinks.contiguous() if call.sinks is not None else None
        warm = (
            q.shape[1],
            k_cache.shape[1:],
            k_cache.dtype,
            q.dtype,
            window,
            cap,
            None if sinks is None else sinks.dtype,
            chunk,
        )
        if warm not in self._warmed:  # first layer of its kind: compile every variant it can need
            self._warmed.add(warm)
            if not tk.interpreted() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                tk.precompile(q.shape[1], k_cache, v_cache, q.dtype, scaling, window, cap, sinks, chunk)
        if call.store:  # a KV-shared layer's K/V are its producer's, already in this cache layer
            tk.store_kv(k_new, v_new, k_cache, v_cache, md.slot_mapping)
        out = torch.empty(q.shape, dtype=query.dtype, device=query.device)
        if self.fixed_order:  # each query alone, one split (a decode-only step's rows already are)
            table, lens = md.per_query if md.per_query is not None else (md.block_table, md.seq_lens)
            tk.paged_decode_attention(
                q, k_cache, v_cache, table, lens, scaling, window, cap, 1, out=out, sinks=sinks, chunk=chunk
            )
            return out.unsqueeze(0)
        if md.num_decode:
            splits = md.num_splits
            if splits is None:
                eff_len = min(md.max_decode_seq_len, window) if window else md.max_decode_seq_len
                eff_len = min(eff_len, chunk) if chunk else eff_len
                splits = tk.choose_num_splits(md.num_decode, k_cache.shape[2], eff_len, q.device)
            tk.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                md.block_table,
                md.seq_lens,
                scaling,
                window,
                cap,
                splits,
                # a decode-only step has one row per sequence, in order: no query_start_loc needed
                query_start_loc=md.query_start_loc if md.has_prefill else None,
                out=out,
                sinks=sinks,
                chunk=chunk,
            )
        if md.has_prefill:
            tk.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                md.block_table,
                md.query_start_loc,
                md.seq_lens,
                md.max_q_len,
                scaling,
                window,
                cap,
                skip_decode=md.num_decode > 0,
                out=out,
                sinks=sinks,
                chunk=chunk,
            )
        return out.unsqueeze(0)  # [1, T, H, D]

    def _latent(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, nope + rope]
        key: torch.Tensor,  # [1, 1, T, r + rope]: the step's latent
        ctx: StepContext,
        call: AttentionCall,
        lat: LatentExpand,
    ) -> torch.Tensor:
        """An MLA layer paged as its latent (see the module's docstring); ``[1, T, H, v_dim]``."""
        md: TritonMetadata = ctx.metadata
        pages = ctx.kv_cache.k[layer]  # [num_blocks, block_size, 1, r + rope]
        q = query[0]  # [H, T, nope + rope]
        heads = q.shape[0]
        scale = call.scaling if call.scaling is not None else q.shape[2] ** -0.5  # the model's, of nope + rope
        window = call.sliding_window or None
        cap = call.softcap or None
        chunk = call.chunk or None
        sinks = call.sinks.contiguous() if call.sinks is not None else None
        warm = ("latent", heads, pages.shape[1:], pages.dtype, q.dtype, window, cap, sinks is not None, chunk)
        if warm not in self._warmed:  # the latent kernel's variants (the B1 chunks' compile at first use)
            self._warmed.add(warm)
            if not tk.interpreted() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                tk.precompile_latent(heads, pages, lat.rank, q.dtype, scale, window, cap, sinks, chunk)
        if call.store:
            new = key[0].transpose(0, 1)  # [T, 1, r + rope]
            tk.store_kv(new, new, pages, pages, md.slot_mapping)
        out = query.new_empty(md.num_tokens, heads, lat.v_dim)
        # absorbs_chunk holds for every chunk up to a length: the longest of this step's it holds for
        plan = latent_plan(md, max((n for n in md.num_new if absorbs_chunk(lat, n)), default=0))
        if plan.count:
            qa = lat.absorb_query(q if plan.tokens is None else q.index_select(1, plan.tokens))  # [H, N, r + rope]
            o = tk.paged_latent_attention(
                qa.transpose(0, 1),
                pages,
                md.block_table,
                plan.seq_lens,
                lat.rank,
                scale,
                window,
                cap,
                md.num_splits,
                rows=plan.rows,
                max_seq_len=plan.max_len,
                sinks=sinks,
                chunk=chunk,
            )  # [N, H, r]
            vals = lat.unabsorb(o)  # [N, H, v_dim]
            if plan.tokens is None:
                out.copy_(vals)
            else:
                out.index_copy_(0, plan.tokens, vals.to(out.dtype))
        for i, first in plan.expanded:
            self._expanded(md, i, first, lat, q, pages, out, scale, window, cap, sinks, chunk)
        return out.unsqueeze(0)

    def _expanded(
        self,
        md: TritonMetadata,
        i: int,  # the sequence
        first: int,  # its first token
        lat: LatentExpand,
        q: torch.Tensor,  # [H, T, nope + rope]
        pages: torch.Tensor,  # [num_blocks, block_size, 1, r + rope]
        out: torch.Tensor,  # [T, H, v_dim]: the sequence's rows are written
        scale: float,
        window: int | None,
        cap: float | None,
        sinks: torch.Tensor | None,
        chunk: int | None,
    ) -> None:
        """B1: sequence ``i``'s latent pages gathered and expanded by the module's own ``expand_kv``
        (keys ``[H, L, nope + rope]``, values ``[H, L, v_dim]``, the narrower zero-padded), viewed as
        pages of the cache's block size under a block-table row ``0..nb - 1``, then the prefill kernel
        over them (causal, bottom-right) for the sequence's queries."""
        bs, width = pages.shape[1], pages.shape[3]
        n = md.num_new[i]
        nb = -(-(md.start_pos[i] + n) // bs)
        k, v = lat(pages.index_select(0, md.block_table[i, :nb]).view(1, 1, nb * bs, width))
        d = max(k.shape[-1], v.shape[-1])
        qs = q[:, first : first + n].transpose(0, 1)  # [n, H, nope + rope]
        qs, k, v = (F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] < d else t for t in (qs, k, v))
        kp = k[0].transpose(0, 1).unflatten(0, (nb, bs))  # [nb, bs, H, d] (a view)
        vp = v[0].transpose(0, 1).unflatten(0, (nb, bs))
        qsl = md.query_start_loc[i : i + 2]
        o = tk.paged_prefill_attention(
            qs,
            kp,
            vp,
            torch.arange(nb, device=pages.device).view(1, nb),
            qsl - qsl[0],  # [0, n], on the device
            md.seq_lens[i : i + 1],
            n,
            scale,
            window,
            cap,
            sinks=sinks,
            chunk=chunk,
        )  # [n, H, d]
        out[first : first + n] = o[..., : lat.v_dim]
