"""The CPU backend: decode rows attend over the paged cache where it lies, through acb's own
kernel (:mod:`acb.runner.attention.cpu_kernels`); everything else as the torch backend.

The torch backend gathers each decode row's pages into a workspace and runs SDPA on the copy,
padded to its group's longest row. Here each decode row's query reads its keys and values in
their pages: no copy, no padding, and a row's sums run over its keys in the same order whatever
the batch holds. Prefill chunks (their queries are many: SDPA's blocked matrix products win) and
the layers the kernel does not take (indexed attention, a cache that is not float32) run as in
the torch backend, which stays the reference the tests compare against.

On by default on CPU where the kernel builds (a C compiler is on the machine; see
:func:`acb.runner.attention.cpu_kernels.load`) and agrees with the torch backend
(:func:`acb.runner.attention.check_backend`); ``attn_backend="torch"`` keeps the reference.
"""

from __future__ import annotations

import torch

from acb.runner.attention import BatchInputs, cpu_kernels
from acb.runner.attention.torch_backend import TorchBackend, TorchMetadata


def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded here, else why not."""
    if cpu_kernels.load() is None:
        return cpu_kernels.problem() or "the kernel did not load"
    return None


class CpuBackend(TorchBackend):
    name = "cpu"
    supports_graphs = False

    def build_metadata(self, batch: BatchInputs, block_size: int) -> TorchMetadata:
        md = super().build_metadata(batch, block_size)
        if md.decode:
            rows, toks, lens = [], [], []
            tok = 0
            for i, n in enumerate(batch.num_new):
                if n == 1:
                    rows.append(i)
                    toks.append(tok)
                    lens.append(batch.start_pos[i] + 1)
                tok += n
            table = batch.block_table
            if table.dtype != torch.long or table.stride(-1) != 1:
                table = table.to(torch.long).contiguous()
            md.kernel_rows = (table, torch.tensor(rows), torch.tensor(toks), torch.tensor(lens))
        return md

    def _decode(
        self,
        md: TorchMetadata,
        q: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        out: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        chunk: int | None,
        index: torch.Tensor | None,
    ) -> None:
        if (
            md.kernel_rows is None
            or index is not None
            or q.dtype != torch.float32
            or k_pages.dtype != torch.float32
            or q.device.type != "cpu"
            or v_pages.shape != k_pages.shape
            or not (k_pages.is_contiguous() and v_pages.is_contiguous())
            or q.stride(2) != 1
        ):
            return super()._decode(
                md, q, k_pages, v_pages, out, scaling, sliding_window, softcap, sinks, chunk, index
            )
        table, rows, toks, lens = md.kernel_rows
        cpu_kernels.paged_attention(
            q.transpose(0, 1),  # [T, H, D]
            k_pages,
            v_pages,
            table,
            rows,
            toks,
            lens,
            out,
            scaling if scaling is not None else q.shape[-1] ** -0.5,
            softcap,
            sliding_window,
            chunk,
            sinks.to(torch.float32).contiguous() if sinks is not None else None,
        )
