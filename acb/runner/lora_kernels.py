"""LoRA's two Triton kernels in the punica SGMV style (issue 56): the "kernel" form of
:mod:`acb.runner.lora` on CUDA.

A step's adapter rows are the token indices ``order`` sorted by slot, in runs of equal slots
``(slot, start, count)``; the runs reach the kernels as a device tensor ``runs [R, 3]`` (int32), so
a launch reads no host value of the step but the grid's size, and no argument that varies from
step to step is specialised on (the linear's shapes and strides are the same every step). Inside a
decode graph the same kernels run per row (:func:`per_row_runs`: ``order = arange(T)``, run ``i``
is ``(slot of row i, i, 1)``, built on the device from the graph's static slots), so the grid is
``(T, 1)`` for a graph of ``T`` rows and nothing of the step is baked in:

* **shrink** (:func:`_shrink_kernel`, grid ``(run, row tile)``): ``Y[i] = X[order[i]] @ A[slot]^T``
  for each row ``i`` of the run, ``[count, r_max]`` at the slot's ``r_max``-padded rank (``A`` is
  zero past the adapter's rank), stored in ``X``'s dtype as the grouped form's first matmul is;
* **expand** (:func:`_expand_kernel`, grid ``(run, row tile, column tile)``):
  ``out[order[i]] += (Y[i] @ B[slot]^T) * scaling[slot]``, PEFT's order: the delta is computed,
  rounded to ``out``'s dtype, scaled, rounded again, then added.

Each row's reduction runs in a fixed order (``in`` in ``BLOCK_K`` tiles, then the one rank tile),
and each output row is written by one program per column tile, so there are no atomics and the
result does not depend on the batch's other rows. A slot whose scaling is 0 (its adapter does not
target this linear) is skipped. Under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported) the dots are upcast to fp32, as :mod:`acb.runner.attention.triton_kernels` does (the
interpreter's bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from acb.runner.attention.triton_kernels import interpreted  # (set at triton's import: one answer for both)

__all__ = ["lora_apply", "per_row_runs", "runs_tensor"]

BLOCK_M = 16
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, out_dtype=tl.float32)


@triton.jit
def _run_rows(runs_ptr, scale_ptr, order_ptr, run, tile, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program's run (slot, start, count, read from the device) and row tile: the slot, its
    scaling, the run's rows to update (none for a skipped slot: scaling 0), the tile's row mask,
    its rows' positions in the sorted order and their tokens, and the rank's offsets and mask."""
    slot = tl.load(runs_ptr + run * 3).to(tl.int64)
    start = tl.load(runs_ptr + run * 3 + 1)
    count = tl.load(runs_ptr + run * 3 + 2)
    scale = tl.load(scale_ptr + slot)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = tl.where(scale != 0.0, count, 0)
    mask_m = offs_m < live
    idx = (start + offs_m).to(tl.int64)
    tok = tl.load(order_ptr + idx, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    return slot, scale, live, mask_m, idx, tok, offs_r, mask_r


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    order_ptr,
    runs_ptr,
    scale_ptr,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ym,
    K,
    R,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32: tl.constexpr,
):
    run = tl.program_id(0)
    tile = tl.program_id(1)
    slot, scale, live, mask_m, idx, tok, offs_r, mask_r = _run_rows(
        runs_ptr, scale_ptr, order_ptr, run, tile, R, BLOCK_M, BLOCK_R
    )
    # an idle tile (past the run's rows, or a skipped slot) runs no iteration
    k_end = tl.where(tile * BLOCK_M < live, K, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + tok[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        a = tl.load(
            a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=mask_r[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A[slot]^T
        acc += _dot(x, a, F32)
    tl.store(
        y_ptr + idx[:, None] * stride_ym + offs_r[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_r[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    order_ptr,
    runs_ptr,
    scale_ptr,
    stride_ym,
    stride_bs,
    stride_bn,
    stride_om,
    N,
    R,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32: tl.constexpr,
):
    run = tl.program_id(0)
    tile = tl.program_id(1)
    col = tl.program_id(2)
    slot, scale, live, mask_m, idx, tok, offs_r, mask_r = _run_rows(
        runs_ptr, scale_ptr, order_ptr, run, tile, R, BLOCK_M, BLOCK_R
    )
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(y_ptr + idx[:, None] * stride_ym + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
        mask=mask_n[None, :] & mask_r[:, None],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B[slot]^T
    out_ty = out_ptr.dtype.element_ty
    d = _dot(y, b, F32).to(out_ty)  # lora_B(lora_A(x)) in the linear's dtype
    d = (d.to(tl.float32) * scale).to(out_ty)  # * scaling (a Python float in PEFT)
    mask = mask_m[:, None] & mask_n[None, :]
    o_ptrs = out_ptr + tok[:, None] * stride_om + offs_n[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + d.to(tl.float32)).to(out_ty), mask=mask)


def runs_tensor(runs: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """The step's host runs ``(slot, start, count)`` as the kernels' ``[R, 3]`` int32 device
    tensor (one asynchronous copy from pinned memory on CUDA: no sync)."""
    host = torch.tensor(runs, dtype=torch.int32).reshape(-1, 3)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def per_row_runs(slots: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The decode graphs' per-row runs: row ``i`` is the run ``(slots[i], i, 1)`` of ``order =
    arange(T)`` (``[T, 3]`` int32, made on the device from the graph's static slots: no host value;
    slot-0 rows, scaling 0, are skipped by the kernels and keep their bits)."""
    return torch.stack((slots, order, torch.ones_like(order)), 1).to(torch.int32)


def lora_apply(
    x: torch.Tensor,
    out: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: torch.Tensor,
    order: torch.Tensor,
    runs: torch.Tensor,
    max_count: int,
) -> None:
    """``out[order[i]] += (x[order[i]] @ A[slot]^T @ B[slot]^T) * scale[slot]`` for each run
    ``(slot, start, count)`` of ``runs`` and each ``i`` in ``start..start+count``, in place.

    ``x [T, in]`` and ``out [T, out]`` (row-major rows), ``A [S, r_max, in]`` and
    ``B [S, out, r_max]`` contiguous, ``scale [S]`` fp32 (0: skip the slot), ``order [n]`` the
    token indices sorted by slot, ``runs [R, 3]`` int32 (:func:`runs_tensor`), ``max_count`` the
    largest run's count (a host value: the grid's row tiles)."""
    n_runs = runs.shape[0]
    if n_runs == 0 or max_count == 0:
        return
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not (A.is_contiguous() and B.is_contiguous()):
        raise ValueError("lora_apply needs unit-stride rows of x and out, and contiguous A and B")
    S, r_max, K = A.shape
    N = B.shape[1]
    if B.shape != (S, N, r_max) or x.shape[-1] != K or out.shape[-1] != N or scale.shape != (S,):
        raise ValueError(
            f"lora_apply: shapes x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(A.shape)}, "
            f"B {tuple(B.shape)}, scale {tuple(scale.shape)} do not agree"
        )
    f32 = interpreted() or x.dtype == torch.float32
    block_r = max(16, triton.next_power_of_2(r_max))
    y = torch.empty((order.shape[0], r_max), dtype=x.dtype, device=x.device)
    m_tiles = triton.cdiv(max_count, BLOCK_M)
    _shrink_kernel[(n_runs, m_tiles)](
        x, A, y, order, runs, scale, x.stride(0), A.stride(0), A.stride(1), y.stride(0), K, r_max,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, F32=f32,
    )  # fmt: skip
    _expand_kernel[(n_runs, m_tiles, triton.cdiv(N, BLOCK_N))](
        y, B, out, order, runs, scale, y.stride(0), B.stride(0), B.stride(1), out.stride(0), N, r_max,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, F32=f32,
    )  # fmt: skip
