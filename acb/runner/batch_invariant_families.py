"""The batch-invariant mode (:mod:`acb.runner.batch_invariant`) for families beyond dense attention:
what in each makes a request's bits depend on the rest of its step, and the fixed form the mode
runs instead, in the engine and in a trainer's forward under ``enabled(model)`` alike.

**Gated delta rule state layers** (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: the model's own
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` / ``causal_conv1d_*``).
The chunked form splits a call's tokens into 64-token chunks from the call's first token and
sums within a chunk by batched products and triangular solves: a token's bits follow where the
chunk boundaries fall, which the token budget (chunked prefill), a prefix hit's restore point or a
trainer's whole-sequence call (left padding included) sets, and the batched solves' order follows
the call's rows. In the mode every multi-token call runs the model's own recurrent form instead
(one token at a time, element-wise products and a reduction over the key dimension per state
element: the order per token is fixed by the token's own inputs and the state before it, so a
prompt computed whole, in chunks, after a prefix hit's snapshot, or in a trainer's batch gives the
same bits; a left pad's zeroed input leaves a zero state exactly zero). The causal convolution
runs one fixed form too (the kernel's taps in order, element-wise: the whole-sequence form and
the decode form's window give each output the same sums; torch's depthwise ``conv1d`` picks its
kernel by shape). Both are installed over the model's module functions (:func:`install`) and
route to the fixed form on a thread with the mode on, to the model's own elsewhere.

**Transcendental element-wise ops** (sigmoid, exp, softplus, SiLU, GELU, tanh, erf, log, sin/cos:
:data:`_SCALAR_FUNCS`). torch computes a contiguous tensor's elements in vector blocks (Sleef) and
its last ``numel mod 2 * lanes`` elements (of each thread's range) in a scalar loop (libm), whose
last bits differ: a token's ``beta = sigmoid(b)`` (4 values a token, measured) took the other path
as the call's length moved it into the tail, and so does a dense MLP's activation whose width is
not a multiple of the vector block (SiLU over 76, GELU-tanh over 100: measured). In the mode the
whole forward on CPU (:func:`whole_forward`, entered by the engine's step and by
``enabled(model)``) computes these ops by torch's vector code for every element (:func:`vector_path`: the
input flattened, padded to a multiple of the vector block, in calls torch runs on one thread, so
no element falls in a scalar tail): every element the same function (Sleef's, lane by lane)
whatever its position, the call's length, the batch or the threads. (:func:`scalar_path`, every
element through the scalar loop instead, is as invariant and 16x slower per element: measured.) The hooks on state layers and gate
modules (:func:`install`) enter the same path where no whole forward is open (the emulated CUDA
form, :data:`acb.runner.batch_invariant.KERNEL`, on CPU tensors); inside one they do nothing. The
division, products, sums and rsqrt are correctly rounded in both paths.

**Mamba2's selective scan** (Mamba2, Nemotron-H: ``mamba2_chunk_scan`` /
``mamba2_selective_state_update``). The chunk scan (``chunk_size`` tokens from the call's first)
sums a token's state over the chunks before it in one reduction, so an engine resuming from a state
and a trainer's whole sequence associate the sums differently. In the mode every token runs the
decode form's update (:func:`_m2_inputs`, :func:`_m2_read`: the state times its decay plus the token's input), the
read-out of the state a product and a sum over the state size (the decode form's ``bmm`` is the
library's order), for prefill, decode and a trainer's forward alike.

**Mamba1's selective scan** (Mamba, Falcon-Mamba, Jamba: ``mamba_selective_scan`` /
``mamba_selective_state_update``) the same way: every token through the decode form's update, the
read-out a product and a sum; the layer's ``dt_proj.weight @ x`` (a matrix product outside
``F.linear``) goes through the mode's linear, a token a row.

**Kimi's delta attention** (Kimi Linear, Ling/Bailing hybrids: ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention``, a gated delta rule whose decay is per key channel) as the gated
delta rule's: every multi-token call runs the model's own recurrent form, and both forms get their
per-token inputs contiguous (:func:`_dense_inputs`: the layer hands them views of the convolution's
output whose key dimension is strided by the call's length, so the L2 norm's sum over it took
another order at a prompt's length than at a decode step's: measured).

**MiniMax's lightning attention** and **Zaya's CCA projection** keep their scan or products in the
layer's forward itself, not in module functions: the mode routes the class's forward
(:data:`_LAYER_FORMS`, :func:`_routed_forward`; the engine's interception of the layer takes the
routed one, :mod:`acb.runner.linear_state`) to the model's own forward run a fixed way. MiniMax's
block form (matrix products over ``block_size``-token blocks from the call's first token) is
replaced by its own decode branch for every token, from a zero state where none is held
(:class:`_ZeroStart`), its ``k^T v`` and ``q S`` a product and a sum (:class:`_LayerOps`); a left
pad's zeroed ``k, v`` leave a zero state exactly zero. Zaya's depthwise and grouped convolutions
over the query and key projections (``nn.Conv1d``: torch's kernel by shape, over the kept window
at decode and the whole prompt at prefill) run in one tap order (:func:`fixed_group_conv`). (Here
torch's ``conv1d`` gave a window's output the whole prompt's bits at every shape tried: 96-1536
channels, 1 and 2 threads, batches of 1 and 24; the fixed order keeps the guarantee off that
measurement, oneDNN picking its kernel by shape and CPU.)

A state layer class with none of these (:func:`covered_state_layer`) is named by
:func:`uncovered_state_layer` and the mode refuses it; every state layer class acb finds in
transformers' models today has one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from acb.runner.batch_invariant_flag import is_on

# the model-module functions the mode replaces, by name: the gated delta rule's
_CHUNK = "torch_chunk_gated_delta_rule"
_RECURRENT = "torch_recurrent_gated_delta_rule"
_CONV_FN = "causal_conv1d_fn"
_CONV_UPDATE = "causal_conv1d_update"
# Kimi's delta attention (Kimi Linear, Ling/Bailing hybrids: a gated delta rule with a decay per key
# channel), by the same names in each model's module
_KDA_CHUNK = "chunk_kimi_delta_attention"
_KDA_RECURRENT = "recurrent_kimi_delta_attention"

_LOCK = threading.Lock()
_INSTALLED: set[str] = set()  # module names whose functions are routed


def _on() -> bool:
    return is_on()


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    from transformers.activations import ACT2FN

    return ACT2FN[activation](x)


def fixed_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """The depthwise causal convolution of ``x`` ``[B, C, L]`` (its first ``K - 1`` columns the
    left context: zeros or a kept state) with ``weight`` ``[C, K]``: ``L - K + 1`` outputs, each the
    taps summed in order (element-wise, no fused products), so an output's bits depend on its K
    inputs only."""
    k = weight.shape[-1]
    n = x.shape[-1] - k + 1
    w = weight.to(x.dtype)
    acc = x[..., 0:n] * w[:, 0:1]
    for j in range(1, k):
        acc = acc + x[..., j : j + n] * w[:, j : j + 1]
    if bias is not None:
        acc = acc + bias.to(acc.dtype)[:, None]
    return _act(acc, activation)


def _conv_fn(original: Callable[..., Any]) -> Callable[..., Any]:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if not _on() or hidden_states.device.type != "cpu":
            return original(hidden_states, weight, bias=bias, activation=activation, **kwargs)
        dtype = hidden_states.dtype
        x = F.pad(hidden_states.to(weight.dtype), (weight.shape[-1] - 1, 0))
        return fixed_conv(x, weight, bias, activation).to(dtype)

    causal_conv1d_fn.acb_fixed = True  # type: ignore[attr-defined]
    return causal_conv1d_fn


def _conv_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
        if not _on() or hidden_states.device.type != "cpu":
            return original(hidden_states, conv_state, weight, bias, activation, **kwargs)
        seq_len = hidden_states.shape[-1]
        full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
        conv_state.copy_(full[:, :, -conv_state.shape[-1] :])
        k = weight.shape[-1]
        out = fixed_conv(full[:, :, -(seq_len + k - 1) :], weight, bias, activation)
        return out.to(hidden_states.dtype)

    causal_conv1d_update.acb_fixed = True  # type: ignore[attr-defined]
    return causal_conv1d_update


def _chunk(original: Callable[..., Any], recurrent: Callable[..., Any]) -> Callable[..., Any]:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, **kwargs):
        if not _on() or query.device.type != "cpu":
            return original(query, key, value, g, beta, chunk_size, initial_state, **kwargs)
        kwargs.pop("cu_seqlens", None)
        return recurrent(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)

    torch_chunk_gated_delta_rule.acb_fixed = True  # type: ignore[attr-defined]
    return torch_chunk_gated_delta_rule


def _dense_inputs(recurrent: Callable[..., Any]) -> Callable[..., Any]:
    """Kimi's recurrent form with its per-token inputs made contiguous first (in the mode, on CPU).
    The layer hands it views of the convolution's ``[B, C, L]`` output, whose key dimension has
    stride ``L``: the query's and key's L2 norm (a sum over that dimension) then reduces a strided
    row at a prompt's length and a contiguous one at a decode step's, in another order (measured:
    a decoded token's output moved by 1e-8). Contiguous, every call sums a row alike."""
    if getattr(recurrent, "acb_fixed", False):
        return recurrent

    def recurrent_kimi_delta_attention(query, key, value, g, beta, *args, **kwargs):
        if _on() and query.device.type == "cpu":
            query, key, value, g, beta = (t.contiguous() for t in (query, key, value, g, beta))
        return recurrent(query, key, value, g, beta, *args, **kwargs)

    recurrent_kimi_delta_attention.acb_fixed = True  # type: ignore[attr-defined]
    return recurrent_kimi_delta_attention


# the element-wise transcendentals torch vectorizes with Sleef and finishes with libm (function and
# method forms; in-place forms are not taken: the fixed path writes a new tensor)
_SCALAR_FUNCS = {
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.exp,
    torch.Tensor.exp,
    torch.exp2,
    torch.Tensor.exp2,
    torch.tanh,
    torch.Tensor.tanh,
    torch.log,
    torch.Tensor.log,
    torch.log1p,
    torch.Tensor.log1p,
    torch.expm1,
    torch.Tensor.expm1,
    torch.erf,
    torch.Tensor.erf,
    torch.erfc,
    torch.Tensor.erfc,
    torch.sin,
    torch.Tensor.sin,
    torch.cos,
    torch.Tensor.cos,
    F.softplus,
    F.silu,
    F.sigmoid,
    F.gelu,  # (approximate='none' and 'tanh')
    F.mish,
    F.tanh,
}
_INPLACE_ARG = {F.silu, F.mish}  # (their second positional argument is ``inplace``)

# the vector path's call: a multiple of any vector block (2 x 16 float lanes, AVX-512) and at most
# 16,384 elements, which torch runs on one thread (its element-wise grain is 32,768; GELU's own
# threshold for splitting across threads is above 16,384), so every element takes the vector code
_BLOCK = 64
_PIECE = 16384


def scalar_path(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(x, ...)`` with every element computed by torch's scalar loop: ``x`` copied into the
    even columns of a twice-as-wide buffer, whose stride-2 view torch cannot vectorize
    (differentiable)."""
    wide = torch.stack([x, torch.zeros_like(x)], dim=-1)
    return fn(wide[..., 0], *args, **kwargs)


def vector_path(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``fn(x, ...)`` with every element computed by torch's vector code (Sleef, lane by lane: an
    element's bits its own): ``x`` flattened, padded with zeros to a multiple of :data:`_BLOCK`, and
    taken in calls of at most :data:`_PIECE` elements, each one thread's range with no scalar tail
    (differentiable). The mode's fixed form: the same bits as :func:`scalar_path` gives position-free,
    at a fraction of its cost."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % _BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() <= _PIECE:
        out = fn(flat, *args, **kwargs)
    else:
        out = torch.cat([fn(piece, *args, **kwargs) for piece in flat.split(_PIECE)])
    return (out[:n] if pad else out).view(x.shape)


# the ops whose autograd saves their output (the others save their input): the fixed path's
# Function saves the same, so a checkpoint's recomputed forward (autograd's backward runs without
# the mode: the plain op) fills the same saved tensors
_SAVES_OUTPUT = {
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.exp,
    torch.Tensor.exp,
    torch.exp2,
    torch.Tensor.exp2,
    torch.expm1,
    torch.Tensor.expm1,
    torch.tanh,
    torch.Tensor.tanh,
}


class _Fixed(torch.autograd.Function):
    """:func:`vector_path` under autograd, saving what the plain op saves (its input, or its output:
    :data:`_SAVES_OUTPUT`); the gradient is the op's own derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        y = vector_path(fn, x, *args, **kwargs)
        ctx.fn, ctx.args, ctx.kwargs = fn, args, kwargs
        ctx.save_for_backward(y if fn in _SAVES_OUTPUT else x)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (t,) = ctx.saved_tensors
        fn = ctx.fn
        if fn in (torch.sigmoid, torch.Tensor.sigmoid):
            return torch.ops.aten.sigmoid_backward(g, t), None, None, None
        if fn in (torch.tanh, torch.Tensor.tanh):
            return torch.ops.aten.tanh_backward(g, t), None, None, None
        if fn in (torch.exp, torch.Tensor.exp):
            return g * t, None, None, None
        if fn in (torch.exp2, torch.Tensor.exp2):
            return g * t * math.log(2.0), None, None, None
        if fn in (torch.expm1, torch.Tensor.expm1):
            return g * (t + 1), None, None, None
        with torch.enable_grad():  # an input-saving op: its own derivative at the input
            xi = t.detach().requires_grad_()
            (gx,) = torch.autograd.grad(fn(xi, *ctx.args, **ctx.kwargs), xi, g)
        return gx, None, None, None


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


class _ScalarPath(torch.overrides.TorchFunctionMode):
    """:data:`_SCALAR_FUNCS` on float32 CPU tensors through :func:`vector_path` (a fixed path:
    the name is its first form's, :func:`scalar_path`); a 2-D weight times
    a batch of columns (Mamba1's ``dt_proj.weight @ x``) through the mode's linear, a token a row."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and not kwargs:
            w, x = args
            if (
                isinstance(w, torch.Tensor)
                and isinstance(x, torch.Tensor)
                and w.dim() == 2
                and x.dim() == 3
                and w.dtype == x.dtype == torch.float32
                and w.device.type == x.device.type == "cpu"
            ):
                return F.linear(x.transpose(1, 2), w).transpose(1, 2)
        if func in _SCALAR_FUNCS and args and "out" not in kwargs and not kwargs.get("inplace"):
            x = args[0]
            if (
                isinstance(x, torch.Tensor)
                and x.dtype == torch.float32
                and x.device.type == "cpu"
                and x.numel()
                and not (func in _INPLACE_ARG and len(args) > 1 and args[1])
            ):
                if torch.is_grad_enabled() and x.requires_grad:
                    return _Fixed.apply(x, func, args[1:], kwargs)
                return vector_path(func, x, *args[1:], **kwargs)  # (the mode is off inside its handler)
        return func(*args, **kwargs)


_TLS = (
    threading.local()
)  # .modes: the fixed-path modes entered by the hooks, innermost last; .whole: inside :func:`whole_forward`


class _WholeForward:
    """:class:`_ScalarPath` for a whole forward on the calling thread (nested ones do nothing)."""

    def __init__(self) -> None:
        self._mode: _ScalarPath | None = None

    def __enter__(self) -> None:
        if not getattr(_TLS, "whole", False):
            _TLS.whole = True
            self._mode = _ScalarPath()
            self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            _TLS.whole = False


# False: the mode without the whole forward's fixed path (benchmarks/batch_invariance.py measures
# its cost against it; not invariant then for widths off the vector block)
WHOLE_FORWARD = True


def whole_forward(cpu: bool) -> contextlib.AbstractContextManager[Any]:
    """Every transcendental element-wise op (:data:`_SCALAR_FUNCS`) of a forward on float32 CPU
    tensors through :func:`scalar_path` until the block's end, on the calling thread (``cpu``; else
    nothing: CUDA's element-wise kernels have no scalar tail). The engine's step in the mode
    (``engine_step``) and a trainer's forward under ``enabled(model)`` both run in one."""
    return _WholeForward() if cpu and WHOLE_FORWARD else contextlib.nullcontext()


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    stack = getattr(_TLS, "modes", None)
    if stack is None:
        stack = _TLS.modes = []
    if _on() and not getattr(_TLS, "whole", False):  # (inside a whole forward's: already on)
        mode = _ScalarPath()
        mode.__enter__()
        stack.append(mode)
    else:
        stack.append(None)


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    mode = _TLS.modes.pop()
    if mode is not None:
        mode.__exit__(None, None, None)


_M2_CHUNK = "mamba2_chunk_scan"
_M2_STEP = "mamba2_selective_state_update"


def _m2_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's per-token decay and input, as the model's decode form computes them, for tokens
    in any leading dimensions (``x`` ``[..., h, p]``, ``dt`` ``[..., h, p]``, ``A`` ``[h, p, n]``,
    ``B`` ``[..., g, n]``): ``(exp(dt A), dt B x)``, ``[..., h, p, n]`` each. Element-wise only
    (the fixed path gives an element its bits wherever it sits), so a prompt's tokens at once
    give what one token a call gives."""
    *lead, h, _ = x.shape
    g, n = B.shape[-2], B.shape[-1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]
    dA = torch.exp(dt.float() * A.float())
    Bh = B.reshape(*lead, g, 1, n).expand(*lead, g, h // g, n).reshape(*lead, h, 1, n)
    return dA, (dt * Bh) * x[..., None]


def _m2_read(state: torch.Tensor, x: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """One token's output from its new state ``[b, h, p, n]``: the state times ``C`` summed over
    ``n`` (a product and a sum: the decode form's ``bmm`` is the library's order), plus ``D x``."""
    b, h, _ = x.shape
    g, n = C.shape[1], C.shape[-1]
    Ch = C.reshape(b, g, 1, n).expand(b, g, h // g, n).reshape(b, h, 1, n)
    out = (state.to(Ch.dtype) * Ch).sum(-1)
    if D is not None:
        out = (out + x * D).to(out.dtype)
    return out


def _m2_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def mamba2_selective_state_update(
        state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
    ):
        if not _on() or hidden_states.device.type != "cpu":
            return original(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, **kwargs)
        dA, dBx = _m2_inputs(hidden_states, dt, A, B, dt_bias, dt_softplus)
        new = state * dA + dBx
        state.copy_(new.to(state.dtype))
        out = _m2_read(new, hidden_states, C, D)
        if z is not None:
            out = out * F.silu(z)
        return out.to(hidden_states.dtype)

    mamba2_selective_state_update.acb_fixed = True  # type: ignore[attr-defined]
    return mamba2_selective_state_update


def _m2_chunk(original: Callable[..., Any]) -> Callable[..., Any]:
    def mamba2_chunk_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        **kwargs,
    ):
        if not _on() or hidden_states.device.type != "cpu":
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                chunk_size,
                D=D,
                dt_bias=dt_bias,
                initial_states=initial_states,
                dt_softplus=dt_softplus,
                dt_limit=dt_limit,
                return_final_states=return_final_states,
                **kwargs,
            )
        b, length, h, p = hidden_states.shape
        n = B.shape[-1]
        # the tokens as the decode form takes them (its dt_limit is not applied there either): the
        # element-wise inputs at once, then the state a token at a time
        dA, dBx = _m2_inputs(
            hidden_states,
            dt[..., None].expand(-1, -1, -1, p),
            A[:, None, None].expand(-1, p, n),
            B,
            dt_bias[:, None].expand(-1, p) if dt_bias is not None else None,
            dt_softplus,
        )
        d = D[:, None].expand(-1, p) if D is not None else None
        state = initial_states if initial_states is not None else hidden_states.new_zeros(b, h, p, n)
        outs = []
        for t in range(length):
            state = state * dA[:, t] + dBx[:, t]
            outs.append(_m2_read(state, hidden_states[:, t], C[:, t], d).to(hidden_states.dtype))
        y = torch.stack(outs, dim=1)
        return (y, state) if return_final_states else y

    mamba2_chunk_scan.acb_fixed = True  # type: ignore[attr-defined]
    return mamba2_chunk_scan


_M1_SCAN = "mamba_selective_scan"
_M1_STEP = "mamba_selective_state_update"


def _m1_inputs(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1's per-token decay and input as its decode form computes them (``x``, ``dt`` ``[...,
    d]``, ``A`` ``[d, n]``, ``B`` ``[..., n]``): ``[..., d, n]`` each, element-wise only."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    dA = torch.exp(dt.float()[..., None] * A.float())
    return dA, (dt.float()[..., None] * B.float()[..., None, :]) * x.float()[..., None]


def _m1_read(
    state: torch.Tensor, x: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """One token's output from its new state ``[b, d, n]``: times ``C`` summed over ``n`` (not the
    decode form's matmul), plus ``D x``, gated by SiLU(``z``)."""
    out = (state.to(C.dtype) * C[:, None, :]).sum(-1)
    if D is not None:
        out = out + x * D
    if z is not None:
        out = out * F.silu(z)
    return out


def _m1_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def mamba_selective_state_update(
        state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
    ):
        if not _on() or hidden_states.device.type != "cpu":
            return original(state, hidden_states, dt, A, B, C, D, dt_bias, dt_softplus, z, **kwargs)
        dA, dBx = _m1_inputs(hidden_states, dt, A, B, dt_bias, dt_softplus)
        new = state.float() * dA + dBx
        state.copy_(new.to(state.dtype))
        return _m1_read(new, hidden_states, C, D, z).to(hidden_states.dtype)

    mamba_selective_state_update.acb_fixed = True  # type: ignore[attr-defined]
    return mamba_selective_state_update


def _m1_scan(original: Callable[..., Any]) -> Callable[..., Any]:
    def mamba_selective_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        **kwargs,
    ):
        if not _on() or hidden_states.device.type != "cpu":
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                D=D,
                z=z,
                delta_bias=delta_bias,
                delta_softplus=delta_softplus,
                return_last_state=return_last_state,
                **kwargs,
            )
        b, d, length = hidden_states.shape
        x = hidden_states.transpose(1, 2)  # [b, L, d]
        dA, dBx = _m1_inputs(x, dt.transpose(1, 2), A, B.transpose(1, 2), delta_bias, delta_softplus)
        state = hidden_states.new_zeros(b, d, A.shape[-1], dtype=torch.float32)  # (the scan takes no state)
        outs = []
        for t in range(length):
            state = state * dA[:, t] + dBx[:, t]
            zt = z[:, :, t] if z is not None else None
            outs.append(_m1_read(state, x[:, t], C[:, :, t], D, zt).to(hidden_states.dtype))
        y = torch.stack(outs, dim=-1)
        return (y, state) if return_last_state else y

    mamba_selective_scan.acb_fixed = True  # type: ignore[attr-defined]
    return mamba_selective_scan


def fixed_group_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, groups=groups)`` (stride 1, no padding) summed in one fixed order:
    ``x`` ``[B, C_in, L]``, ``weight`` ``[C_out, C_in / groups, K]``; each output the products of its
    group's input channels (outer) and taps (inner) added in turn, element-wise, then the bias, so an
    output's bits depend on its own inputs only (torch's ``conv1d`` picks its kernel, and its order,
    by the call's shape)."""
    b, _, length = x.shape
    out_ch, per_group, k = weight.shape
    n = length - k + 1
    xg = x.reshape(b, groups, 1, per_group, length)
    wg = weight.to(x.dtype).reshape(groups, out_ch // groups, per_group, k)
    acc: torch.Tensor | None = None
    for c in range(per_group):
        for j in range(k):
            term = xg[:, :, :, c, j : j + n] * wg[None, :, :, c, j, None]
            acc = term if acc is None else acc + term
    assert acc is not None
    out = acc.reshape(b, out_ch, n)
    return out + bias.to(out.dtype)[:, None] if bias is not None else out


def _plain(value: Any, default: int) -> bool:
    return all(v == default for v in (value if isinstance(value, (tuple, list)) else (value,)))


class _LayerOps(torch.overrides.TorchFunctionMode):
    """Inside a state layer's fixed forward (MiniMax's lightning attention, Zaya's CCA projection),
    the products torch would pick a kernel for by shape, on float32 CPU tensors, in fixed forms: a
    4-D ``matmul`` as a product and a sum over the inner dimension (one product where it is 1),
    ``conv1d`` (stride 1, no padding or dilation) as :func:`fixed_group_conv`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and not kwargs:
            a, b = args
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dim() == b.dim() == 4
                and a.dtype == b.dtype == torch.float32
                and a.device.type == b.device.type == "cpu"
            ):
                return (a[..., :, :, None] * b[..., None, :, :]).sum(-2)
        if func is F.conv1d and not kwargs and len(args) >= 2:
            x, w = args[0], args[1]
            bias, stride, padding, dilation, groups = (*args[2:], None, 1, 0, 1, 1)[:5]
            if (
                isinstance(x, torch.Tensor)
                and x.dim() == 3
                and x.dtype == torch.float32
                and x.device.type == "cpu"
                and _plain(stride, 1)
                and _plain(padding, 0)
                and _plain(dilation, 1)
                and isinstance(groups, int)
            ):
                return fixed_group_conv(x, w, bias, groups)
        return func(*args, **kwargs)


class _ZeroStart:
    """MiniMax's cache argument in the mode: the layer's state as held (the engine's per-request
    cache, a trainer's ``MiniMaxCache``, or none), and a zero state where none is held yet, so the
    layer's forward takes its decode branch (a token at a time) from a prompt's first token."""

    def __init__(self, cache: Any, zeros: torch.Tensor) -> None:
        self.cache = cache
        self.zeros = zeros

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        held = self.cache.get_linear_cache(layer_idx) if self.cache is not None else None
        return held if isinstance(held, torch.Tensor) else self.zeros

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.set_linear_cache(layer_idx, linear_cache)


def _lightning(own: Callable[..., Any], layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """MiniMax's lightning attention in the mode: its own forward, every token through its decode
    branch (the state times its decay plus the token's ``k^T v``, the output ``q`` times the state),
    from a zero state where none is held (:class:`_ZeroStart`), the two products in fixed forms
    (:class:`_LayerOps`). Its block form sums a block's tokens by matrix products over the call's
    ``block_size``-token blocks from its first token, as the chunked scans do."""
    params = list(inspect.signature(own).parameters)[1:]
    bound = dict(zip(params[1:], args))
    bound.update(kwargs)
    cache = bound.get("past_key_values")
    b = hidden_states.shape[0]
    d = layer.head_dim
    zeros = hidden_states.new_zeros(b, layer.num_attention_heads, d, d, dtype=torch.float32)
    bound["past_key_values"] = _ZeroStart(cache, zeros)
    with _LayerOps():
        return own(layer, hidden_states, **bound)


def _cca(own: Callable[..., Any], layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Zaya's CCA projection in the mode: its own forward, its two convolutions over the query and
    key projections (depthwise, then grouped) in one fixed order (:class:`_LayerOps`), so a token's
    outputs are the same bits whether its window came from the prompt or from the kept state."""
    with _LayerOps():
        return own(layer, hidden_states, *args, **kwargs)


# state layer classes whose scan or products sit in the forward itself, not in module functions
# (by class name): the fixed form the mode runs in place of the forward
_LAYER_FORMS: dict[str, Callable[..., Any]] = {
    "MiniMaxLightningAttention": _lightning,
    "ZayaCCAProjection": _cca,
}


def _routed_forward(own: Callable[..., Any], fixed: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _on() or hidden_states.device.type != "cpu":
            return own(self, hidden_states, *args, **kwargs)
        return fixed(own, self, hidden_states, *args, **kwargs)

    forward.acb_fixed = True  # type: ignore[attr-defined]
    return forward


# the state-layer families the mode has fixed forms for: the model module's function names, each
# with what the mode puts in its place
_FAMILIES: dict[str, dict[str, Callable[[Any, Callable[..., Any]], Callable[..., Any]]]] = {
    "gated delta rule": {
        _CHUNK: lambda mod, f: _chunk(f, getattr(mod, _RECURRENT)),
        _RECURRENT: lambda mod, f: f,  # (the model's own: the fixed form)
        _CONV_FN: lambda mod, f: _conv_fn(f),
        _CONV_UPDATE: lambda mod, f: _conv_update(f),
    },
    "Kimi delta attention": {
        _KDA_CHUNK: lambda mod, f: _chunk(f, _dense_inputs(getattr(mod, _KDA_RECURRENT))),
        _KDA_RECURRENT: lambda mod, f: _dense_inputs(f),  # (the model's own, on contiguous inputs)
        _CONV_FN: lambda mod, f: _conv_fn(f),
        _CONV_UPDATE: lambda mod, f: _conv_update(f),
    },
    "Mamba1": {
        _M1_SCAN: lambda mod, f: _m1_scan(f),
        _M1_STEP: lambda mod, f: _m1_update(f),
        _CONV_FN: lambda mod, f: _conv_fn(f),
        _CONV_UPDATE: lambda mod, f: _conv_update(f),
    },
    "Mamba2": {
        _M2_CHUNK: lambda mod, f: _m2_chunk(f),
        _M2_STEP: lambda mod, f: _m2_update(f),
        _CONV_FN: lambda mod, f: _conv_fn(f),
        _CONV_UPDATE: lambda mod, f: _conv_update(f),
    },
    # a convolution state alone (LFM2's short convolution); last: the families above use these too
    "short convolution": {
        _CONV_FN: lambda mod, f: _conv_fn(f),
        _CONV_UPDATE: lambda mod, f: _conv_update(f),
    },
}


def _family_of(mod: Any) -> dict[str, Callable[[Any, Callable[..., Any]], Callable[..., Any]]] | None:
    for forms in _FAMILIES.values():
        if all(callable(getattr(mod, name, None)) for name in forms):
            return forms
    return None


def _module_of(cls: type) -> Any:
    return sys.modules.get(cls.__module__)


def covered_state_layer(cls: type) -> bool:
    """Whether the mode has a fixed form for the state layer class ``cls``: one for its forward
    (:data:`_LAYER_FORMS`: MiniMax's lightning attention, Zaya's CCA projection), or its model
    module defines one family's functions (:data:`_FAMILIES`: the gated delta rule's or Kimi's
    delta attention's chunked and recurrent forms, or Mamba1's or Mamba2's scan and state update,
    and the causal convolution's two; or the convolution's two alone, for a layer whose only state
    is a convolution's)."""
    from acb.runner.linear_state import conv_only

    if cls.__name__ in _LAYER_FORMS:
        return True
    mod = _module_of(cls)
    forms = _family_of(mod) if mod is not None else None
    if forms is _FAMILIES["short convolution"]:  # (a scan of its own beside them would not be covered)
        return conv_only(cls)
    return forms is not None


def uncovered_state_layer(model: torch.nn.Module) -> str | None:
    """The first state layer class of ``model`` the mode has no fixed form for (its name), else None."""
    from acb.runner.linear_state import linear_layers

    for layer in linear_layers(model):
        if not covered_state_layer(type(layer)):
            return type(layer).__name__
    return None


def gate_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward applies an element-wise sigmoid over a few values per token: an
    MoE block whose router scores by sigmoid (a child with ``e_score_correction_bias``: DeepSeek-V3,
    GLM, Nemotron-H), a block with a shared expert's one-value gate (``shared_expert_gate``:
    Qwen3-Next, Qwen2-MoE), Llama 4's router. In the mode their element-wise ops take the scalar
    path (:func:`install`), so a token's gate no longer depends on the call's length."""
    cfg: Any = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    llama4 = text is not None and str(getattr(text, "model_type", "")).startswith("llama4")
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        for name, child in m.named_children():
            if hasattr(child, "e_score_correction_bias") or name == "shared_expert_gate":
                found[id(m)] = m  # (the block: its forward applies the sigmoid)
                found[id(child)] = child
            elif llama4 and type(child).__name__.endswith("Router"):
                found[id(child)] = child
    return list(found.values())


def _hook(module: torch.nn.Module) -> None:
    if not getattr(module, "_acb_scalar_path", False):
        module.register_forward_pre_hook(_pre_hook)
        module.register_forward_hook(_post_hook, always_call=True)
        module._acb_scalar_path = True  # type: ignore[assignment]


def install(model: torch.nn.Module) -> None:
    """Route the model's state layers' functions (or, for :data:`_LAYER_FORMS`' classes, their
    forward) to the fixed forms on threads with the mode on (once per model module or class;
    idempotent; elsewhere the model's own run, unchanged)."""
    from acb.runner.linear_state import linear_layers

    for gate in gate_modules(model):
        _hook(gate)
    for layer in linear_layers(model):
        cls = type(layer)
        if not covered_state_layer(cls):
            continue
        _hook(layer)  # the layer's own element-wise ops
        fixed = _LAYER_FORMS.get(cls.__name__)
        if fixed is not None:
            with _LOCK:
                if not getattr(cls.forward, "acb_fixed", False):
                    cls.forward = _routed_forward(cls.forward, fixed)
            continue
        mod = _module_of(cls)
        with _LOCK:
            if mod.__name__ in _INSTALLED:
                continue
            forms = _family_of(mod)
            assert forms is not None
            for name, wrap in forms.items():
                own = getattr(mod, name)
                if not getattr(own, "acb_fixed", False):
                    setattr(mod, name, wrap(mod, own))
            _INSTALLED.add(mod.__name__)


class _PerImageFeatures:
    """A trainer's forward's image-feature calls, an image a call (as the engine's in the mode:
    :class:`acb.runner.media.ImageFeatures`), nothing kept past the call (the weights change
    between a trainer's steps)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from acb.runner.media import ImageFeatures

        class _Transient(ImageFeatures):
            def _call(self, module: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super()._call(module, *args, **kwargs)
                finally:
                    if not self._inside:
                        self.clear()

        self.features = _Transient(model)
        self._serving = self.features.serving() if self.features.modules else None
        if self._serving is not None:
            self._serving.__enter__()

    def close(self) -> None:
        if self._serving is not None:
            self._serving.__exit__(None, None, None)
            self._serving = None


class TrainerForms:
    """What ``enabled(model)`` adds for these families: the state layers' fixed forms installed,
    and the model's image features an image a call, until :meth:`close`."""

    def __init__(self, model: torch.nn.Module) -> None:
        install(model)
        self._images = _PerImageFeatures(model)

    def close(self) -> None:
        self._images.close()


def text_attention(model: torch.nn.Module, impl: str) -> str | dict[str, str]:
    """What ``set_attn_implementation`` takes to give ``impl`` to the model's language model only:
    a VLM's vision tower keeps its own attention (non-causal, as the engine runs it), so
    ``{"text_config": impl}`` where the text is a sub-config, else ``impl``."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    if text is None or text is cfg:
        return impl
    for key in getattr(cfg, "sub_configs", {}) or {}:
        if getattr(cfg, key, None) is text:
            return {key: impl}
    return impl


def text_attention_of(model: torch.nn.Module) -> str | None:
    """The language model's attention implementation (the text config's)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    return getattr(text, "_attn_implementation", None)


def lora_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run LoRA adapters on ``model`` (None: it can). On CPU acb applies an
    adapter as PEFT does, per slot's rows: ``out + lora_B(lora_A(x)) * scaling`` with two
    ``F.linear`` (the mode's fixed linear, each row its own bits) and an element-wise add, so a
    row's result is the one a trainer's ``PeftModel`` forward computes under ``enabled(model)``.
    A fused MoE's experts' adapters are folded into the weights as PEFT folds them (the same
    ``baddbmm``) and the experts' products are the mode's fixed linear per expert, so they hold too.
    The other forms are not: the gathered one (``bmm``: :data:`acb.runner.lora.GATHERED`) and the
    Triton kernels (:data:`acb.runner.lora.KERNEL`)."""
    from acb.runner import lora

    p = next(model.parameters(), None)
    if p is not None and p.device.type != "cpu":
        return "on CUDA, LoRA runs acb's Triton kernels, not the mode's fixed linear: CPU-checked only"
    if lora.GATHERED is True:  # (None, the per-step pick, takes the grouped form in the mode)
        return "acb.runner.lora.GATHERED forces LoRA's gathered form (bmm over the step's rows), not the mode's"
    if lora.KERNEL:
        return "acb.runner.lora.KERNEL runs LoRA's Triton kernels, not the mode's fixed linear"
    return None
