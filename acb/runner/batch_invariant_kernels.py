"""The batch-invariant mode's matrix product on a GPU: a Triton kernel of fixed reduction order.

``out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])``, the mode's linear (every ``nn.Linear`` and the
LM head, :mod:`acb.runner.batch_invariant`) on CUDA tensors.

Why a row's bits do not depend on the row count, its position or the other rows:

- **One tile configuration for every call** (:data:`BLOCK_M`, :data:`BLOCK_N`, :data:`BLOCK_K`,
  warps and stages fixed per dtype): no autotuning keyed on ``M``, no split-K, no stream-K. A
  program owns a ``BLOCK_M x BLOCK_N`` output tile and walks ``K`` from 0 upwards in
  ``BLOCK_K`` steps, adding each step's tile product into one fp32 accumulator: the same
  sequence of additions for an output element whatever ``M`` is. Rows past ``M`` are loaded as
  zeros and never stored; they enter no other row's sums (a tile product's element ``(i, j)``
  reads only row ``i`` of ``x`` and column ``j`` of ``w``).
- **No specialisation on ``M``**: Triton compiles a variant per integer argument equal to 1 or
  divisible by 16; ``M`` is excluded (``do_not_specialize``), so one row, 16 rows and 17 rows
  run the same compiled code.
- Operands: bf16/fp16 go to ``tl.dot`` natively (fp32 accumulator); fp32 uses IEEE fp32
  products (no TF32). Under the Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests) every
  operand is upcast to fp32 first, as in :mod:`acb.runner.attention.triton_kernels` (the
  interpreter's low-precision ``tl.dot`` is wrong for bf16).

The result equals ``torch.nn.functional.linear`` up to rounding (not bit for bit: cuBLAS picks
its own tiles and split-K by shape, which is what the mode avoids).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from acb.runner.attention.triton_kernels import interpreted

__all__ = ["linear", "matmul", "DTYPES", "BLOCK_M", "BLOCK_N", "BLOCK_K"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one fixed order over K, one accumulator
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` (any strides), of
    one dtype in :data:`DTYPES`; returns a contiguous ``[M, N]`` of that dtype. Each row's bits
    are those it gets alone (see the module's docstring)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul takes [M, K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"matmul takes one dtype of {DTYPES} for both operands, got {x.dtype} and {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x,
        weight,
        bias.contiguous() if bias is not None else out,
        out,
        m,
        n,
        k,
        *x.stride(),
        *weight.stride(),
        *out.stride(),
        HAS_BIAS=bias is not None,
        F32=interpreted() or x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through :func:`matmul`: ``x`` ``[..., K]``, ``weight`` ``[N, K]``."""
    shape = x.shape
    out = matmul(x.reshape(-1, shape[-1]), weight, bias)
    return out.reshape(*shape[:-1], weight.shape[0])
