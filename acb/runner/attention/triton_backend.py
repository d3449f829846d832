"""The Triton attention backend: paged kernels that read K/V straight from the block cache.

Per layer: one kernel writes the step's new K/V into the cache, then

* a decode-only step (every sequence has one query) runs the split-K decode kernel;
* any other step runs the prefill kernel for the sequences with more than one query and, when
  some have exactly one, the decode kernel for those, both over the whole flattened batch
  (each kernel skips the other's sequences; no gather, no host sync).

Metadata is built once per step from host values (``num_new``, ``max_seq_len``) and shared by
every layer. Needs a CUDA device, or the Triton interpreter (``TRITON_INTERPRET=1``) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from acb.runner.attention import AttentionCall, BatchInputs, StepContext
from acb.runner.attention import triton_kernels as tk


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
    )


class TritonBackend:
    name = "triton"
    features = frozenset({"sinks", "chunk"})
    supports_graphs = True  # decode reads every length from device tensors: only the split count is baked

    def __init__(self) -> None:
        self._warmed: set[tuple] = set()  # layer settings whose kernel variants are compiled

    def graph_variants(self, num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> list[int]:
        """Decode split counts worth a graph at this padded batch size: one split (short contexts)
        and, when longer contexts would split, the count chosen for ``max_len``. Any count is
        correct for any length (empty splits weigh nothing), so a graph never computes stale
        results, only a suboptimal partition."""
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
        return metadata_for(batch)

    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        ctx: StepContext,
        call: AttentionCall,
    ) -> torch.Tensor:
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
