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

Also here, for the rest of a forward on CUDA:

- :func:`row_mean` and :class:`FixedReductions`: RMSNorm's mean over the hidden size, one program a
  row (torch's CUDA reduction lays out a row's sum by the tensor's shape, the row count included).
- :func:`whole_sequence_attention`: a trainer's forward over whole sequences through the decode
  kernel with one split, one query a program: the bits ``TritonBackend(fixed_order=True)`` gives
  each query over an engine's paged cache.

An engine with ``batch_invariant=True`` on CUDA runs them (:mod:`acb.runner.batch_invariant`:
``linear``, ``engine_step``/``enabled`` and the transformers attention function), eager (no decode
graphs in the mode yet). Tests run them under the interpreter on CPU with
``acb.runner.batch_invariant.KERNEL = True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from acb.runner.attention.triton_kernels import interpreted

__all__ = [
    "linear",
    "matmul",
    "row_mean",
    "FixedReductions",
    "whole_sequence_attention",
    "DTYPES",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
]

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


# ---------------------------------------------------------------- row reductions (RMSNorm's mean)


@triton.jit(do_not_specialize=["R", "stride_xr"])
def _row_mean_kernel(x_ptr, out_ptr, R, N, stride_xr, stride_xn, BLOCK: tl.constexpr):
    """One program per row: the row's elements summed in BLOCK-wide strips from 0 upwards into one
    fp32 vector, then one fixed tree (``tl.sum``) and a division by N."""
    r = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + r * stride_xr + n * stride_xn, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.sum(acc, 0) / N)


def row_mean(x: torch.Tensor, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x.mean(-1, keepdim, dtype=dtype)`` with each row's bits its own: one program a row, the
    strip width set by the row's length only. (torch's CUDA reduction picks its threads per row
    from the tensor's shape, the row count included: ``ReduceConfig`` gives one row 512 threads
    and 64 rows 32 each, so a row's sum is added in another order; RMSNorm's mean is one.)"""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _row_mean_kernel[(x2.shape[0],)](x2, out, x2.shape[0], n, *x2.stride(), BLOCK=block, num_warps=4)
    elif x2.shape[0]:
        out.fill_(float("nan"))
    out = out.to(dtype or x.dtype).reshape(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def _last_dim_only(dims: Any, ndim: int) -> bool:
    if dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and dims[0] % max(ndim, 1) == ndim - 1


class FixedReductions(TorchDispatchMode):
    """While pushed (a torch dispatch mode: per thread), ``aten.mean.dim`` over a tensor's last dim
    (RMSNorm's ``hidden.pow(2).mean(-1, keepdim=True)``, and qk-norms') runs :func:`row_mean` on
    the tensors ``applies`` accepts (default: CUDA float tensors); every other op runs as it was.
    Autograd is above the mode: a mean's backward is torch's own."""

    def __init__(self, applies: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()
        self.applies = applies or (lambda t: t.is_cuda)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.mean.dim:
            x = args[0]
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            dtype = args[3] if len(args) > 3 else kwargs.get("dtype")
            if x.dtype in DTYPES and x.dim() >= 1 and _last_dim_only(dims, x.dim()) and self.applies(x):
                return row_mean(x, keepdim=keepdim, dtype=dtype)
        return func(*args, **kwargs)


# ---------------------------------------------------------------- a trainer's attention over whole sequences


def whole_sequence_attention(
    query: torch.Tensor,  # [B, H, Q, D]: the last Q of each row's S positions
    key: torch.Tensor,  # [B, KVH, S, D]
    value: torch.Tensor,
    pads: list[int],  # each row's left padding
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of whole (left-padded) sequences through the Triton decode kernel, one
    query a program and one split, as the Triton backend's fixed-order form
    (``TritonBackend(fixed_order=True)``) computes each query over an engine's paged cache: each
    row's keys, from its first unpadded position, are one page of ``S`` positions, and a query at
    position ``p`` (from that start) sees ``p + 1`` of them. Returns ``[B, Q, H, D]`` (queries on
    padding: zeros)."""
    from acb.runner.attention import triton_kernels as tk

    b, h, q, d = query.shape
    s = key.shape[2]
    k = key.transpose(1, 2)  # [B, S, KVH, D]
    v = value.transpose(1, 2)
    if any(pads):  # each row's keys moved to start at page position 0
        idx = torch.stack([(torch.arange(s, device=key.device) + p).clamp(max=s - 1) for p in pads])
        idx = idx[:, :, None, None]
        k = k.gather(1, idx.expand(-1, -1, *k.shape[2:]))
        v = v.gather(1, idx.expand(-1, -1, *v.shape[2:]))
    k = k.contiguous()
    v = v.contiguous()
    qt = query.transpose(1, 2).reshape(b * q, h, d)
    rows = torch.arange(b, device=query.device).repeat_interleave(q)
    qabs = torch.arange(s - q, s, device=query.device)  # each query's index among the keys
    pad = torch.tensor(pads, device=query.device, dtype=torch.long)
    lens = (qabs[None, :] - pad[:, None] + 1).clamp(min=0).reshape(-1)
    out = tk.paged_decode_attention(qt, k, v, rows[:, None], lens, scale, window, softcap, 1, sinks=sinks, chunk=chunk)
    return out.view(b, q, h, d)
