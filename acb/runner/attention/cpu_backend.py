"""The CPU backend: decode rows attend over the paged cache where it lies, through acb's own
kernel (:mod:`acb.runner.attention.cpu_kernels`); everything else as the torch backend.

The torch backend gathers each decode row's pages into a workspace and runs SDPA on the copy,
padded to its group's longest row. Here each decode row's query reads its keys and values in
their pages: no copy, no padding, and a row's sums run over its keys in the same order whatever
the batch holds. Short prefill chunks after a cached prefix (``MAX_KERNEL_CHUNK_WORK``) go to the
kernel the same way, one query token at a time. Longer prefill chunks (their queries are many:
SDPA's blocked matrix products win) and the layers the kernel does not take (indexed attention,
a cache that is not float32, image tokens that attend both ways) run as in the torch backend,
which stays the reference the tests compare against. In the batch-invariant mode
(``fixed_order``) every query goes to the kernel, an image token's keys running to its image's
end (:func:`_media_lens`).

On by default on CPU where the kernel builds (a C compiler is on the machine; see
:func:`acb.runner.attention.cpu_kernels.load`) and agrees with the torch backend
(:func:`acb.runner.attention.check_backend`); ``attn_backend="torch"`` keeps the reference.
"""

from __future__ import annotations

import torch

from acb.runner.attention import AttentionCall, BatchInputs, cpu_kernels
from acb.runner.attention.torch_backend import TorchBackend, TorchMetadata, decode_groups_of

# Host fast path (issue 54, item 5): a decode-only step's metadata without Python loops over its
# rows. False builds it the general way every step (benchmarks' A/B; the same metadata either way).
REUSE = True

# a prefill chunk after a cached prefix runs its queries through the kernel too (scoring
# continuations) when its queries times its context is at most this; larger chunks gather the
# prefix and run SDPA, whose blocked matrix products win there. Measured (8 chunks after 512
# cached tokens, 32 after 128; benchmarks/paged_decode_attention.py --chunks, 2026-11-28): kernel
# against gather + SDPA 2.66x at 2 x 514, 1.27x at 4 x 516, 0.88x at 8 x 520, 0.49x at 16 x 528;
# 3.22x at 4 x 132, 1.81x at 8 x 136
MAX_KERNEL_CHUNK_WORK = 3072


def _to_kernel(start: int, n: int, fixed_order: bool = False) -> bool:
    """Whether a prefill chunk of ``n`` queries after ``start`` cached tokens goes to the kernel
    (every one in the batch-invariant mode: a query's sums then run over its keys in position
    order however its prompt was chunked)."""
    return fixed_order or (start > 0 and n * (start + n) <= MAX_KERNEL_CHUNK_WORK)


def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded here, else why not."""
    if cpu_kernels.load() is None:
        return cpu_kernels.problem() or "the kernel did not load"
    return None


class CpuBackend(TorchBackend):
    name = "cpu"
    supports_graphs = False

    def __init__(self, fixed_order: bool = False) -> None:
        super().__init__()
        # the batch-invariant mode (acb.runner.batch_invariant): every query through the kernel,
        # and a layer the kernel cannot take is an error, not the torch path
        self.fixed_order = fixed_order
        self._aranges: dict[int, torch.Tensor] = {}  # n -> arange(n): a decode-only step's rows and tokens

    def build_metadata(self, batch: BatchInputs, block_size: int) -> TorchMetadata:
        n = len(batch.num_new)
        if REUSE and batch.slot_mapping.numel() == n:
            return self._decode_metadata(batch, block_size)
        md = super().build_metadata(batch, block_size)
        # short chunks after a cached prefix: their queries go to the kernel beside the decode rows
        fixed = self.fixed_order
        md.kernel_prefills = [p for p in md.prefills if _to_kernel(p.ctx_len - p.q_len, p.q_len, fixed)]
        if md.kernel_prefills:
            md.prefills = [p for p in md.prefills if not _to_kernel(p.ctx_len - p.q_len, p.q_len, fixed)]
        if md.decode_rows or md.kernel_prefills:
            rows: list[int] = []
            toks: list[int] = []
            lens: list[int] = []
            tok = 0
            for i, n in enumerate(batch.num_new):
                if n == 1 or _to_kernel(batch.start_pos[i], n, fixed):
                    rows.extend([i] * n)
                    toks.extend(range(tok, tok + n))
                    lens.extend(range(batch.start_pos[i] + 1, batch.start_pos[i] + n + 1))
                tok += n
            md.kernel_rows = (self._table(batch), torch.tensor(rows), torch.tensor(toks), torch.tensor(lens))
        return md

    def _decode_metadata(self, batch: BatchInputs, block_size: int) -> TorchMetadata:
        """A decode-only step (every row one query token): the kernel's rows and tokens are
        ``arange(B)`` (made once per B) and each row's keys its ``seq_lens``, already on the
        device; the torch path's decode groups are built only if a layer falls back to it."""
        n = len(batch.num_new)
        ar = self._aranges.get(n)
        if ar is None:
            ar = self._aranges[n] = torch.arange(n, dtype=torch.long)
        dec = list(range(n))
        return TorchMetadata(
            slot_mapping=batch.slot_mapping,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            num_tokens=n,
            block_size=block_size,
            prefills=[],
            decode_rows=n,
            build_groups=lambda: decode_groups_of(batch, block_size, dec, list(range(n + 1))),
            kernel_rows=(self._table(batch), ar, ar, batch.seq_lens),
        )

    @staticmethod
    def _table(batch: BatchInputs) -> torch.Tensor:
        table = batch.block_table
        if table.dtype != torch.long or table.stride(-1) != 1:
            table = table.to(torch.long).contiguous()
        return table

    def _decode(
        self,
        md: TorchMetadata,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        out: torch.Tensor,
        la: AttentionCall,
    ) -> None:
        if (
            md.kernel_rows is None
            or la.index is not None
            # an MLA layer's latent goes to the torch path: B3 there (one SDPA over the latent head, the
            # heads folded into the query length) measured 1.3-2.2x faster than this kernel taking the
            # latent pages as K and V with G = H (acb.runner.latent)
            or la.latent is not None
            or (la.media_blocks and not self.fixed_order and _media_prefills(md, la))
            or q.dtype != torch.float32
            or k_pages.dtype != torch.float32
            or q.device.type != "cpu"
            or v_pages.shape != k_pages.shape
            or not (k_pages.is_contiguous() and v_pages.is_contiguous())
            or q.stride(2) != 1
        ):
            if self.fixed_order:
                raise RuntimeError(
                    "batch_invariant=True: this attention layer cannot run on acb's fixed-order CPU kernel "
                    f"(query {q.dtype}, cache {k_pages.dtype}, K/V pages {tuple(k_pages.shape)}/{tuple(v_pages.shape)}, "
                    f"latent={la.latent is not None}, indexed={la.index is not None})"
                )
            super()._decode(md, q, k_pages, v_pages, out, la)
            for j, p in enumerate(md.kernel_prefills, start=len(md.prefills)):
                self._prefill(md, j, p, q, None, None, k_pages, v_pages, out, la)
            return
        table, rows, toks, lens = md.kernel_rows
        pos = None
        if la.media_blocks and self.fixed_order and _media_prefills(md, la):  # an image's tokens see its later ones
            lens, pos = _media_lens(md)
        cpu_kernels.paged_attention(
            q.transpose(0, 1),  # [T, H, D]
            k_pages,
            v_pages,
            table,
            rows,
            toks,
            lens,
            out,
            la.scaling if la.scaling is not None else q.shape[-1] ** -0.5,
            la.softcap,
            la.sliding_window,
            la.chunk,
            la.sinks.to(torch.float32).contiguous() if la.sinks is not None else None,
            pos,
        )


def _media_prefills(md: TorchMetadata, la: AttentionCall) -> bool:
    """Whether this layer's kernel tokens include a prefill chunk whose image tokens attend to their
    whole image (:class:`acb.runner.media.MediaBlocks`)."""
    return bool(
        la.media_blocks
        and md.media_groups is not None
        and any(p.q_start in md.media_groups.segments for p in md.kernel_prefills)
    )


def _media_lens(md: TorchMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel tokens' key counts on a layer where an image's tokens see each other both ways
    (the batch-invariant mode's prefill): an image token's keys run to its image's end (a chunk
    never ends inside an image: the scheduler's whole spans, so those keys are in the cache by
    now), any other token's to its own position; and each token's position, from which the
    kernel measures a sliding window or an attention chunk. Made once per step."""
    lens_key, pos_key = ("kernel-media-lens",), ("kernel-media-pos",)
    if lens_key not in md._masks:
        assert md.kernel_rows is not None and md.media_groups is not None
        _, _, toks, lens = md.kernel_rows
        ends = torch.zeros(md.num_tokens, dtype=torch.long, device=lens.device)
        for p in md.kernel_prefills:
            groups = md.media_groups.segments.get(p.q_start)
            if groups is None:
                continue
            groups = groups.to(lens.device)
            first = p.ctx_len - p.q_len
            # each image block's end (exclusive): the last position holding its id, plus one
            idx = torch.arange(groups.numel(), device=lens.device)
            last = torch.full((int(groups.max()) + 2,), -1, dtype=torch.long, device=lens.device)
            last.scatter_reduce_(0, groups + 1, idx, reduce="amax")
            q = groups[first : p.ctx_len]
            ends[p.q_start : p.q_start + p.q_len] = torch.where(q >= 0, last[q + 1] + 1, 0)
        md._masks[lens_key] = torch.maximum(lens, ends[toks])
        md._masks[pos_key] = lens - 1
    return md._masks[lens_key], md._masks[pos_key]
