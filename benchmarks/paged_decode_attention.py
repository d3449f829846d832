"""Decode attention over paged K/V on CPU: the torch backend's gather + SDPA against PyTorch's
FlexAttention and acb's own kernel (the CPU backend's), both reading the pages where they lie,
one layer, in one run (issue 43, item 1).

    python benchmarks/paged_decode_attention.py [--cases 1x256,16x256,64x512,128x256] [--out benchmarks/results/paged_decode_attention_cpu.json]

The cache is acb's layout (``[num_blocks, page_size, kv_heads, head_dim]``, page 32, 8 query
heads, 4 KV heads, head size 64: the default benchmark model's), each row's pages scattered at
random. For B rows of C context tokens each:

- **gather + SDPA**: what ``acb/runner/attention/torch_backend.py`` does for a decode group:
  the rows' pages copied into its reused workspace (``index_select``), ``CHUNK_BYTES`` of K/V at
  a time, then SDPA with a length mask;
- **flex, in place**: ``torch.nn.attention.flex_attention`` compiled by inductor (its C++ CPU
  template), the whole cache as one long key sequence, and a ``BlockMask`` whose KV blocks are
  the pages: each row's block list is its block-table row (full pages, then the last, partial
  one under a length mask). Nothing is copied.
- **acb's kernel, in place**: ``acb/runner/attention/cpu_kernels.c`` (the ``"cpu"`` backend's
  decode path, the CPU default since 2026-11-28): each (row, KV head) task reads the row's keys
  and values in their pages, in position order. Nothing is copied, nothing padded.

``--chunks``: prefill chunks after a cached prefix (scoring continuations), the torch backend
(prefix gathered, one SDPA per chunk) against the CPU backend sending every chunk's queries to
its kernel, to place ``acb.runner.attention.cpu_backend.MAX_KERNEL_CHUNK_WORK``.

Each side's time per call is the best of three timed loops; the compile time of the first
flex call is reported too (inductor caches it on disk for later processes). Also measured: the
largest difference between the two, and whether each side's output for a row is the same
bits when the row is attended alone and inside the batch (batch invariance: what exact greedy
parity across batch compositions needs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from acb.bench.common import machine_info, write_json  # noqa: E402
from acb.runner.attention import cpu_kernels  # noqa: E402
from acb.runner.attention.torch_backend import CHUNK_BYTES, TorchBackend  # noqa: E402

H, HKV, D, PAGE = 8, 4, 64, 32


def best_ms(fn: Any, loops: int = 3, n: int = 20) -> float:
    for _ in range(3):
        fn()
    out = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e3)
    return min(out)


def case(b: int, ctx: int, flex: Any) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import BlockMask

    g = torch.Generator().manual_seed(b * 10_000 + ctx)
    pages = -(-ctx // PAGE)
    nb = b * pages + 8
    k_cache = torch.randn(nb, PAGE, HKV, D, generator=g)
    v_cache = torch.randn(nb, PAGE, HKV, D, generator=g)
    table = (torch.randperm(nb - 1, generator=g)[: b * pages] + 1).view(b, pages)
    lens = torch.full((b,), ctx)
    q = torch.randn(b, H, 1, D, generator=g)

    backend = TorchBackend()
    length = pages * PAGE
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    rows_per = max(1, CHUNK_BYTES // (2 * length * HKV * D * 4))

    def gather_sdpa(qq: torch.Tensor = q, tab: torch.Tensor = table) -> torch.Tensor:
        out = torch.empty_like(qq)
        for a in range(0, qq.shape[0], rows_per):
            blocks = tab[a : a + rows_per].reshape(-1)
            kd = backend._gather(k_cache, blocks, "k").view(-1, length, HKV, D).transpose(1, 2)
            vd = backend._gather(v_cache, blocks, "v").view(-1, length, HKV, D).transpose(1, 2)
            m = mask[a : a + rows_per][: kd.shape[0]]
            out[a : a + rows_per] = F.scaled_dot_product_attention(
                qq[a : a + rows_per], kd, vd, attn_mask=m, enable_gqa=True
            )
        return out

    # flex: the cache as one sequence of nb * PAGE keys; row i's KV blocks are its pages
    keys = k_cache.view(1, nb * PAGE, HKV, D).transpose(1, 2)
    values = v_cache.view(1, nb * PAGE, HKV, D).transpose(1, 2)

    def block_mask(tab: torch.Tensor, ln: torch.Tensor) -> Any:
        rows = tab.shape[0]
        logical = torch.full((rows, nb), -1, dtype=torch.long)  # each physical page's place in the row
        logical.scatter_(1, tab, torch.arange(pages).expand(rows, -1))

        def mask_mod(bi: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            at = logical[bi, kv_idx // PAGE]
            return (at >= 0) & (at * PAGE + kv_idx % PAGE < ln[bi])

        full = torch.zeros(rows, 1, 1, nb, dtype=torch.int32)
        full[:, 0, 0, : pages - 1] = tab[:, :-1].to(torch.int32)
        last = torch.zeros(rows, 1, 1, nb, dtype=torch.int32)
        last[:, 0, 0, 0] = tab[:, -1].to(torch.int32)
        return BlockMask.from_kv_blocks(
            torch.ones(rows, 1, 1, dtype=torch.int32),
            last,
            torch.full((rows, 1, 1), pages - 1, dtype=torch.int32),
            full,
            BLOCK_SIZE=(128, PAGE),
            mask_mod=mask_mod,
            seq_lengths=(1, nb * PAGE),
        )

    def in_place(qq: torch.Tensor = q, tab: torch.Tensor = table, ln: torch.Tensor = lens) -> torch.Tensor:
        rows = qq.shape[0]
        return flex(
            qq,
            keys.expand(rows, -1, -1, -1),
            values.expand(rows, -1, -1, -1),
            block_mask=block_mask(tab, ln),
            enable_gqa=True,
        )

    def kernel(qq: torch.Tensor = q, tab: torch.Tensor = table, ln: torch.Tensor = lens) -> torch.Tensor:
        rows = qq.shape[0]
        out = torch.empty(rows, H, D)
        idx = torch.arange(rows)
        cpu_kernels.paged_attention(
            qq[:, :, 0, :], k_cache, v_cache, tab, idx, idx, ln, out, D**-0.5, None, None, None, None
        )
        return out[:, :, None, :]

    t = time.perf_counter()
    got = in_place()
    compile_s = time.perf_counter() - t
    want = gather_sdpa()
    alone_sdpa = gather_sdpa(q[:1], table[:1])
    alone_flex = in_place(q[:1], table[:1], lens[:1])
    bm = block_mask(table, lens)
    mine = kernel()
    alone_mine = kernel(q[:1], table[:1], lens[:1])
    row = {
        "rows": b,
        "context": ctx,
        "gather_sdpa_ms": best_ms(gather_sdpa),
        "flex_in_place_ms": best_ms(
            lambda: flex(q, keys.expand(b, -1, -1, -1), values.expand(b, -1, -1, -1), block_mask=bm, enable_gqa=True)
        ),
        "acb_kernel_ms": best_ms(kernel),
        "acb_kernel_max_abs_diff": (mine - want).abs().max().item(),
        "acb_kernel_row_alone_equals_in_batch": bool(torch.equal(alone_mine[0], mine[0])),
        "block_mask_ms": best_ms(lambda: block_mask(table, lens)),
        "first_flex_call_s": compile_s,
        "max_abs_diff": (got - want).abs().max().item(),
        "sdpa_row_alone_equals_in_batch": bool(torch.equal(alone_sdpa[0], want[0])),
        "flex_row_alone_equals_in_batch": bool(torch.equal(alone_flex[0], got[0])),
    }
    row["flex_speedup"] = row["gather_sdpa_ms"] / row["flex_in_place_ms"]
    row["acb_kernel_speedup"] = row["gather_sdpa_ms"] / row["acb_kernel_ms"]
    return row


def chunk_case(rows: int, prefix: int, n: int) -> dict[str, Any]:
    """``rows`` prefill chunks of ``n`` tokens, each after a cached prefix of ``prefix`` tokens
    (scoring continuations): the torch backend (prefix gathered, SDPA per chunk) against the CPU
    backend sending every chunk's queries to its kernel."""
    from acb.runner.attention import AttentionCall, BatchInputs, StepContext, cpu_backend
    from acb.runner.attention.cpu_backend import CpuBackend
    from acb.runner.kv_cache import KVCache, KVSpec

    g = torch.Generator().manual_seed(rows * 1000 + n)
    lens = [prefix + n] * rows
    cols = -(-(prefix + n) // PAGE)
    table = (torch.randperm(rows * cols, generator=g) + 1).view(rows, cols).long()
    slots = [int(table[i, p // PAGE]) * PAGE + p % PAGE for i in range(rows) for p in range(prefix, prefix + n)]
    batch = BatchInputs(
        slot_mapping=torch.tensor(slots),
        block_table=table,
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.arange(rows + 1) * n,
        num_new=[n] * rows,
        start_pos=[prefix] * rows,
        max_seq_len=prefix + n,
    )
    spec = KVSpec.uniform(1, HKV, D, torch.float32)
    q = torch.randn(1, H, rows * n, D, generator=g)
    k = torch.randn(1, HKV, rows * n, D, generator=g)
    v = torch.randn(1, HKV, rows * n, D, generator=g)
    cache = KVCache(spec, 1 + rows * cols, PAGE, torch.device("cpu"))
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    saved = cpu_backend.MAX_KERNEL_CHUNK_WORK
    cpu_backend.MAX_KERNEL_CHUNK_WORK = 1 << 40  # every chunk to the kernel, whatever its size
    try:
        res = {}
        outs = {}
        for name, backend in (("torch", TorchBackend()), ("kernel", CpuBackend())):
            ctx = StepContext(cache, backend, backend.build_metadata(batch, PAGE))

            def call(b: Any = backend, c: Any = ctx) -> torch.Tensor:
                return b.forward(0, q, k, v, c, AttentionCall())

            outs[name] = call()
            res[f"{name}_ms"] = best_ms(call, n=5)
    finally:
        cpu_backend.MAX_KERNEL_CHUNK_WORK = saved
    return dict(
        rows=rows,
        prefix=prefix,
        chunk=n,
        **res,
        kernel_speedup=res["torch_ms"] / res["kernel_ms"],
        max_abs_diff=(outs["torch"] - outs["kernel"]).abs().max().item(),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x256,16x256,64x512,128x256")
    ap.add_argument(
        "--chunks",
        default="8x512x2,8x512x4,8x512x8,8x512x16,32x128x4,32x128x8",
        help="ROWSxPREFIXxCHUNK: prefill chunks after a cached prefix, torch backend against the kernel",
    )
    ap.add_argument("--out", default="benchmarks/results/paged_decode_attention_cpu.json")
    a = ap.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    assert cpu_kernels.load() is not None, cpu_kernels.problem()
    rows = []
    for spec in a.cases.split(","):
        b, ctx = (int(x) for x in spec.split("x"))
        r = case(b, ctx, flex)
        rows.append(r)
        print(
            f"B={b:4d} context {ctx:5d}: gather+SDPA {r['gather_sdpa_ms']:.2f} ms, flex in place "
            f"{r['flex_in_place_ms']:.2f} ms ({r['flex_speedup']:.2f}x; block mask {r['block_mask_ms']:.2f} ms, "
            f"first call {r['first_flex_call_s']:.1f} s), max diff {r['max_abs_diff']:.1e}, row alone = in batch: "
            f"SDPA {r['sdpa_row_alone_equals_in_batch']}, flex {r['flex_row_alone_equals_in_batch']}; acb kernel "
            f"{r['acb_kernel_ms']:.2f} ms ({r['acb_kernel_speedup']:.2f}x, max diff {r['acb_kernel_max_abs_diff']:.1e}, "
            f"row alone = in batch {r['acb_kernel_row_alone_equals_in_batch']})",
            flush=True,
        )
    chunk_rows = []
    for spec in a.chunks.split(",") if a.chunks else []:
        b, prefix, n = (int(x) for x in spec.split("x"))
        r = chunk_case(b, prefix, n)
        chunk_rows.append(r)
        print(
            f"{b} chunks of {n} after {prefix} cached: torch backend {r['torch_ms']:.2f} ms, kernel "
            f"{r['kernel_ms']:.2f} ms ({r['kernel_speedup']:.2f}x), max diff {r['max_abs_diff']:.1e}",
            flush=True,
        )
    result = {
        "machine": machine_info(),
        "chunks": chunk_rows,
        "shape": {"heads": H, "kv_heads": HKV, "head_dim": D, "page": PAGE, "dtype": "float32"},
        "rows": rows,
    }
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
