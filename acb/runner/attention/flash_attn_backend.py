"""The flash-attn backend: FlashAttention-2's paged-KV entry points over acb's block cache.

* decode-only steps: ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``
  (one query per sequence);
* any other step: ``flash_attn_varlen_func`` with ``block_table`` (flash-attn >= 2.6), over the
  whole flattened batch, causal aligned bottom-right.

Attention sinks (GPT-OSS): flash-attn 2 has no sink argument, but a sink only adds ``exp(sink)``
to each row's softmax denominator, so the output is flash-attn's scaled by
``sigmoid(lse - sink)``, from the log-sum-exp it returns beside it (exact up to rounding).
Chunked-attention layers (Llama 4) have no flash-attn mask: they run acb's Triton kernels over
the same cache, from the same step's metadata.

New K/V are written into the cache first (acb's Triton store kernel, which skips padded rows).
flash-attn's paged KV needs blocks of a multiple of 256 tokens and fp16/bf16; acb picks this
backend automatically only when both hold (``block_size`` unset means 256 with this backend).
Decode reads every length from device tensors and its block table has a fixed width, so its
steps can be captured in CUDA graphs. This is the only module that imports ``flash_attn``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from acb.runner.attention import AttentionCall, BatchInputs, StepContext

PAGE_MULTIPLE = 256  # flash-attn's paged KV cache: page_block_size % 256 == 0
DTYPES = (torch.float16, torch.bfloat16)


def _import() -> Any:
    try:
        import flash_attn
    except ImportError as exc:
        raise ImportError(
            "attn_backend='flash_attn' needs the flash-attn package (pip install flash-attn --no-build-isolation, "
            "on a CUDA machine)"
        ) from exc
    return flash_attn


def unavailable_reason(device: torch.device, dtype: torch.dtype, block_size: int | None) -> str | None:
    """Why this backend cannot run here (None when it can)."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device}"
    if dtype not in DTYPES:
        return f"flash-attn runs fp16/bf16 models, not {dtype}"
    if block_size is not None and block_size % PAGE_MULTIPLE:
        return f"flash-attn's paged KV cache needs block_size to be a multiple of {PAGE_MULTIPLE}, got {block_size}"
    return None


@dataclass
class FlashMetadata:
    slot_mapping: torch.Tensor  # [T] long
    block_table: torch.Tensor  # [B, cols] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_q_len: int
    max_seq_len: int
    decode_only: bool
    triton: Any = None  # the step's Triton metadata, for chunked-attention layers


class FlashAttnBackend:
    name = "flash_attn"
    features = frozenset({"sinks", "chunk"})
    supports_graphs = True

    def __init__(self) -> None:
        fa = _import()
        self._varlen = fa.flash_attn_varlen_func
        self._kvcache = fa.flash_attn_with_kvcache
        self._triton: Any = None  # the Triton backend of chunked-attention layers, made on first use

    def build_metadata(self, batch: BatchInputs, block_size: int) -> FlashMetadata:
        from acb.runner.attention.triton_backend import metadata_for

        seq_lens = batch.seq_lens.to(torch.int32)
        decode_only = batch.slot_mapping.numel() == len(batch.num_new)
        cu_k = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
        if not decode_only:
            torch.cumsum(seq_lens, 0, out=cu_k[1:])
        return FlashMetadata(
            slot_mapping=batch.slot_mapping,
            block_table=batch.block_table.to(torch.int32),
            seq_lens=seq_lens,
            cu_seqlens_q=batch.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_k,
            max_q_len=max(batch.num_new) if batch.num_new else 0,
            max_seq_len=batch.max_seq_len,
            decode_only=decode_only,
            triton=metadata_for(batch),
        )

    # CUDA graphs: one variant per batch size (flash-attn picks its own splits from static shapes)
    def graph_variants(self, num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device) -> list[int]:
        return [0]

    def graph_variant(
        self, variants: list[int], num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
    ) -> int:
        return 0

    def graph_metadata(self, batch: BatchInputs, variant: int) -> FlashMetadata:
        """A decode-only step's metadata (``batch`` holds one query per row): all device tensors."""
        return self.build_metadata(batch, 0)

    def forward(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        ctx: StepContext,
        call: AttentionCall,
    ) -> torch.Tensor:
        from acb.runner.attention import triton_kernels as tk

        md: FlashMetadata = ctx.metadata
        if call.chunk:  # no chunked mask in flash-attn: acb's Triton kernels, same cache and step
            from acb.runner.attention.triton_backend import TritonBackend

            if self._triton is None:
                self._triton = TritonBackend()
            tctx = StepContext(ctx.kv_cache, self._triton, md.triton)
            return self._triton.forward(layer, query, key, value, tctx, call)
        cache = ctx.kv_cache
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if call.store:  # a KV-shared layer's K/V are its producer's, already in this cache layer
            tk.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, md.slot_mapping)
        q = query[0].transpose(0, 1)  # [T, H, D]
        # transformers' sliding window w: a query sees itself and the w - 1 keys before it
        scaling, sinks = call.scaling, call.sinks
        window = (call.sliding_window - 1, 0) if call.sliding_window else (-1, -1)
        cap = float(call.softcap) if call.softcap else 0.0
        lse_too = sinks is not None
        if md.decode_only:
            res = self._kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=md.seq_lens,
                block_table=md.block_table,
                softmax_scale=scaling,
                causal=True,
                window_size=window,
                softcap=cap,
                return_softmax_lse=lse_too,
            )  # [B, 1, H, D] (and the lse, [B, H, 1])
            if lse_too:
                out, lse = res
                assert sinks is not None  # (lse_too is sinks is not None)
                out = _with_sinks(out[:, 0], lse[:, :, 0], sinks)[:, None]
            else:
                out = res
            return out.transpose(0, 1)  # [1, T, H, D]
        res = self._varlen(
            q,
            k_cache,
            v_cache,
            md.cu_seqlens_q,
            md.cu_seqlens_k,
            md.max_q_len,
            md.max_seq_len,
            softmax_scale=scaling,
            causal=True,
            window_size=window,
            softcap=cap,
            block_table=md.block_table,
            return_attn_probs=lse_too,
        )  # [T, H, D] (and the lse, [H, T])
        out = _with_sinks(res[0], res[1].transpose(0, 1), sinks) if lse_too and sinks is not None else res
        return out.unsqueeze(0)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` ([N, H, D]) with each head's sink logit added to its softmax: the
    denominator ``exp(lse)`` becomes ``exp(lse) + exp(sink)``, i.e. ``out * sigmoid(lse - sink)``."""
    w = torch.sigmoid(lse.float() - sinks.float()[None, :])  # [N, H]
    return (out.float() * w[:, :, None]).to(out.dtype)
