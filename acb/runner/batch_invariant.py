"""Batch-invariant, trainer-matched arithmetic on CPU: the ops whose bits would otherwise depend on
what else is in a step (``batch_invariant=True``), and the same ops for a trainer's own forward.

What breaks invariance on CPU, and what the mode does instead (measured on torch 2.13's MKL 2024.2
and oneDNN 3.12; :func:`check_linear` repeats the linear measurement on the machine at hand):

- **Linears.** MKL's sgemm (``F.linear`` on a plain weight) computes a row differently with the
  number of rows in the call and with the thread count (48 of 48 row/position/thread cases
  differed from the row alone, at every shape tried). oneDNN's inner product
  (``torch.ops.mkldnn._linear_pointwise``) gives a row the same bits for every row count from 2
  up (2 to 4099 rows tried), any position, any other rows, 1, 2 or 4 threads, at K up to 11008;
  with exactly one row it takes another kernel (a matrix-vector one, whose K split follows the
  thread count: it differs from the 2-row result at K >= 2048). So the mode's linear is oneDNN's,
  on the weight as the model holds it, with a one-row call padded to two rows (:func:`linear`).
  It is installed as ``torch.nn.functional.linear`` while the mode is on for the calling thread
  (every ``nn.Linear``, an LM head, a fused MoE's per-expert ``F.linear``); on other threads, or
  with the mode off, the original runs. Its backward is the ordinary matrix products (a gradient
  needs no fixed order: the forward's bits are what a logprob is compared by).
- **Attention.** acb's CPU kernel (``cpu_kernels.c``) computes a query over its keys in position
  order, one query at a time, whatever else is in the call: in the mode every query of every
  prefill chunk goes to it too (otherwise a long chunk runs SDPA's blocked products, whose sums
  split the keys by the chunk's shape). A trainer's forward over whole sequences uses the same
  kernel through :data:`ATTN_IMPL_NAME`, a transformers attention function (causal, left padding
  allowed; an image's tokens that see each other both ways, as the model's own mask says, each
  query's keys then running to its image's end: :mod:`acb.runner.batch_invariant_media`); its
  backward recomputes attention with ordinary torch ops.
- **MoE experts.** ``torch.nn.functional.grouped_mm`` (transformers' default experts on CPU) is
  replaced the same way by one fixed linear per expert (:func:`grouped_mm`); the eager experts
  call ``F.linear`` already.
- **MLA.** The mode pages the expanded heads (keys and values at the wider width, as the engine
  does otherwise), attended by the same kernel; the latent's absorbed products are not covered.
- **Norms, the softmax, element-wise ops.** Row reductions over the hidden size (RMSNorm's mean)
  and the log-softmax over the vocabulary run per row in torch's kernels; the sampler's
  log-softmax is the trainer's (:func:`token_logprobs`). These were checked, not changed: the
  tests compare whole engines (a request alone, in a batch of 64, chunked, after a prefix hit, at
  1 and 2 threads) and a trainer's forward bit for bit.
- **Element-wise transcendentals** (SiLU, sigmoid, GELU incl. its tanh form, exp, tanh, erf,
  softplus, log, sin/cos...). torch computes a contiguous tensor's elements in vector blocks
  (Sleef) and the last ``numel mod 2 * lanes`` of each thread's range in a scalar loop (libm),
  whose last bits differ: a token's activations would take one or the other as the step's token
  count (or the thread split) moved them into a tail; an MLP of width 76 (SiLU) or 100 (GELU-tanh)
  moved 4-5 of a request's 10 logprobs with its batch. In the mode the whole forward on CPU (the
  engine's step under :func:`engine_step`, a trainer's under :func:`enabled`) computes them by
  one path, torch's vector code for every element (padded to a whole vector block, in one-thread
  calls: :func:`acb.runner.batch_invariant_families.vector_path`), each element the same function
  wherever it sits (:func:`acb.runner.batch_invariant_families.whole_forward`); the backward is
  the op's own derivative, and the fixed form saves for it what the plain op saves (activation
  checkpointing recomputes the forward in the backward, where the mode's dispatch is not on: the
  plain op refills the same saved tensors). In-place forms (``x.sigmoid_()``) are not taken.

On CUDA (bf16, fp16 or fp32) the same roles are played by :mod:`acb.runner.batch_invariant_kernels`:
a fixed-order Triton matmul for every linear, a per-row mean for RMSNorm (torch's CUDA mean lays
out a row's sum by the row count), the Triton attention backend's fixed-order form in the engine
(every query through the decode kernel with one split) and the same kernel over whole sequences
for a trainer; decode graphs are off in the mode there. Element-wise ops are left as torch runs
them on CUDA: its element-wise kernels compute each element by one code path whatever its index (no
scalar tail; vectorized loads only change how elements are fetched), which is assumed here and
is to be checked on a GPU. :func:`acb.runner.batch_invariant_scope.refusal` names what the mode does not cover.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from acb.runner.batch_invariant_flag import TLS
from acb.runner.batch_invariant_masks import mask_ranges, masked_attention

ATTN_IMPL_NAME = "acb_batch_invariant"  # the trainer-side attention function's name in transformers

_TLS = TLS  # .on: the mode is on for this thread (a leaf module's: the family forms read it too)
_LOCK = threading.Lock()
_ORIGINAL_LINEAR: Callable[..., torch.Tensor] | None = None  # torch's F.linear, kept while ours is installed
_ORIGINAL_GROUPED_MM: Callable[..., torch.Tensor] | None = None  # torch's F.grouped_mm, the same
# the linear's form on CPU tensors: False, oneDNN's; True, the Triton matmul CUDA tensors take (the
# tests run it under TRITON_INTERPRET=1, so the CUDA dispatch is covered without a GPU)
KERNEL = False


def is_on() -> bool:
    """Whether the mode is on for the calling thread."""
    return bool(getattr(_TLS, "on", False))


def _kernel_form(x: torch.Tensor) -> bool:
    """Whether ``x``'s linear is the Triton matmul (CUDA, or :data:`KERNEL`) rather than oneDNN's."""
    return x.device.type == "cuda" or KERNEL


def _fixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product, at least two rows a call (see the module's docstring); on CUDA the
    fixed-order Triton matmul (:mod:`acb.runner.batch_invariant_kernels`)."""
    if _kernel_form(x):
        from acb.runner.batch_invariant_kernels import linear as kernel_linear

        return kernel_linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m < 2:  # one row (or none) takes oneDNN's matrix-vector kernel: pad to two
        x2 = torch.cat([x2, x2.new_zeros(2 - m, x2.shape[1])])
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
    if m < 2:
        out = out[:m]
    return out.reshape(*shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _fixed_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if not (
        x.dtype == weight.dtype
        and weight.dim() == 2
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and x.dim() >= 1
        and weight.device == x.device
    ):
        return False
    if _kernel_form(x):  # the Triton matmul: bf16, fp16, fp32
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return x.device.type == "cpu" and x.dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with each row's bits independent of the other rows and of the thread count
    (float32 CPU tensors; bf16/fp16/fp32 CUDA tensors through the fixed-order Triton matmul;
    anything else goes to torch's own). Differentiable."""
    if not _applies(x, weight):
        return (_ORIGINAL_LINEAR or torch.nn.functional.linear)(x, weight, bias)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _Linear.apply(x, weight, bias)
    return _fixed_linear(x, weight, bias)


def _routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``torch.nn.functional.linear`` is while installed: ours on a thread with the mode on."""
    if getattr(_TLS, "on", False) and _applies(x, weight):
        return linear(x, weight, bias)
    assert _ORIGINAL_LINEAR is not None
    return _ORIGINAL_LINEAR(x, weight, bias)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` (a fused MoE's experts: the rows of group ``g``, up to ``offs[g]``, times
    ``mat_b[g]``) as one :func:`linear` per group: each row's bits its own. Differentiable."""
    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):
        outs.append(linear(mat_a[start:end], mat_b[g].transpose(0, 1)))
        start = end
    if start < mat_a.shape[0]:  # rows past the last group (grouped_mm leaves them unset)
        outs.append(mat_a.new_zeros(mat_a.shape[0] - start, mat_b.shape[-1]))
    return torch.cat(outs)


def _routed_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    *,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What ``torch.nn.functional.grouped_mm`` is while installed: ours on a thread with the mode on."""
    if (
        getattr(_TLS, "on", False)
        and offs is not None
        and bias is None
        and out_dtype in (None, torch.float32)
        and mat_a.dim() == 2
        and mat_b.dim() == 3
        and _applies(mat_a, mat_b[0])
    ):
        return grouped_mm(mat_a, mat_b, offs)
    assert _ORIGINAL_GROUPED_MM is not None
    return _ORIGINAL_GROUPED_MM(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)


def _install() -> None:
    """Put :func:`_routed_linear` in ``torch.nn.functional.linear`` and :func:`_routed_grouped_mm`
    in ``torch.nn.functional.grouped_mm`` (once per process; they call torch's own wherever the
    mode is off, so they stay)."""
    global _ORIGINAL_LINEAR, _ORIGINAL_GROUPED_MM
    with _LOCK:
        if _ORIGINAL_LINEAR is None:
            _ORIGINAL_LINEAR = torch.nn.functional.linear
            torch.nn.functional.linear = _routed_linear  # type: ignore[assignment]
            if hasattr(torch.nn.functional, "grouped_mm"):
                _ORIGINAL_GROUPED_MM = torch.nn.functional.grouped_mm
                torch.nn.functional.grouped_mm = _routed_grouped_mm


def _reductions(cuda: bool) -> contextlib.AbstractContextManager[Any]:
    """The mode's row reductions where tensors are on CUDA (RMSNorm's mean through
    :class:`acb.runner.batch_invariant_kernels.FixedReductions`, a per-thread dispatch mode), else
    nothing (on CPU torch's means are per row)."""
    if not (cuda or KERNEL):
        return contextlib.nullcontext()
    from acb.runner.batch_invariant_kernels import FixedReductions

    return FixedReductions(lambda t: t.is_cuda or KERNEL)


class Enabled:
    """The mode on the thread that called :func:`enable`, until :meth:`close` (idempotent; call it
    on that thread)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        _install()
        self._prev = getattr(_TLS, "on", False)
        self._swap = _AttentionOn(model) if model is not None else None
        if self._swap is not None:
            self._swap.__enter__()
        if model is not None:  # DeepSeek V4's compressed attention (acb.runner.batch_invariant_unpaged)
            from acb.runner.batch_invariant_products import install as install_products
            from acb.runner.batch_invariant_unpaged import install as install_unpaged

            install_unpaged(model)
            install_products(model)  # (a model whose attention is its own code: acb.runner.batch_invariant_products)
        from acb.runner.batch_invariant_families import TrainerForms

        # state layers' fixed forms, image features an image a call (acb.runner.batch_invariant_families)
        self._forms = TrainerForms(model) if model is not None else None
        if model is not None:  # indexers' fixed products and top-k (acb.runner.batch_invariant_dsa)
            from acb.runner.batch_invariant_dsa import install as install_dsa
            from acb.runner.indexed import indexer_modules

            install_dsa(indexer_modules(model))
        p = next(model.parameters(), None) if model is not None else None
        self._red = _reductions(p.is_cuda if p is not None else torch.cuda.is_available())
        self._red.__enter__()  # (CUDA) RMSNorm's mean one program a row
        from acb.runner.batch_invariant_families import whole_forward

        cpu = not (p.is_cuda if p is not None else torch.cuda.is_available()) and not KERNEL
        self._scalar = whole_forward(cpu)  # (CPU) element-wise transcendentals on one fixed path
        self._scalar.__enter__()
        _TLS.on = True
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            _TLS.on = self._prev
            self._scalar.__exit__(None, None, None)
            self._red.__exit__(None, None, None)
            if self._swap is not None:
                self._swap.__exit__(None, None, None)
            if self._forms is not None:
                self._forms.close()

    def __enter__(self) -> Enabled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def enable(model: torch.nn.Module | None = None) -> Enabled:
    """The mode on the calling thread until the returned object's ``close()``: a trainer's forward
    and backward compute what an acb engine with ``batch_invariant=True`` computes, bit for bit.
    With ``model``, its attention is acb's fixed-order function (:data:`ATTN_IMPL_NAME`) until
    then, and its own comes back after. For a whole training run (activation checkpointing
    recomputes the forward inside the backward: it must run the same ops), enable it once."""
    return Enabled(model)


def enabled(model: torch.nn.Module | None = None) -> Enabled:
    """:func:`enable` for a ``with`` block::

    with acb.runner.batch_invariant.enabled(model):
        logits = model(ids).logits
    logprobs = token_logprobs(logits[0, len(prompt) - 1 : -1], completion, temperature)
    """
    return Enabled(model)


@contextlib.contextmanager
def engine_step(cuda: bool) -> Iterator[None]:
    """The engine thread's step in the mode, its model on CUDA (``cuda``) or on CPU (the runner
    enters it only with the mode on)."""
    _install()
    prev = getattr(_TLS, "on", False)
    _TLS.on = True
    from acb.runner.batch_invariant_families import whole_forward

    try:
        with _reductions(cuda), whole_forward(not (cuda or KERNEL)):
            yield
    finally:
        _TLS.on = prev


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int], temperature: float = 1.0) -> torch.Tensor:
    """Each row's logprob of its token, as acb's sampler computes it (float32 logits divided by
    ``temperature``, log-softmax per row, the token's column): ``logits`` ``[T, V]``, one token
    per row. The trainer's side of an exact comparison."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    x = logits.float()
    if temperature != 1.0:
        x = x / torch.tensor([temperature], dtype=torch.float32, device=x.device)[:, None]
    return torch.log_softmax(x, dim=-1).gather(-1, ids[:, None])[:, 0]


# ---------------------------------------------------------------- attention (the trainer's side)


def _kernel_attention(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, KVH, S, D]
    value: torch.Tensor,
    pads: list[int],
    ends: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    window: int | None,
    chunk: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """acb's kernel over whole sequences: each row's keys from its first unpadded position, as
    an engine's cache holds them (positions from 0); each query's keys up to its own position,
    or to ``ends`` (``[B, Q]``, exclusive) where given. Returns ``[B, Q, H, D]``."""
    from acb.runner.attention import cpu_kernels

    b, h, q, d = query.shape
    s = key.shape[2]
    k = key.transpose(1, 2)  # [B, S, KVH, D]
    v = value.transpose(1, 2)
    if any(pads):  # each row's keys moved to start at page position 0
        idx = torch.stack([(torch.arange(s) + p).clamp(max=s - 1) for p in pads])[:, :, None, None]
        k = k.gather(1, idx.expand(-1, -1, *k.shape[2:]))
        v = v.gather(1, idx.expand(-1, -1, *v.shape[2:]))
    k = k.contiguous().float()
    v = v.contiguous().float()
    qt = query.transpose(1, 2).reshape(b * q, h, d).float().contiguous()
    out = torch.zeros(b * q, h, d, dtype=torch.float32)
    table = torch.arange(b, dtype=torch.long)[:, None].contiguous()
    rows = torch.arange(b, dtype=torch.long).repeat_interleave(q)
    toks = torch.arange(b * q, dtype=torch.long)
    qabs = torch.arange(s - q, s, dtype=torch.long)  # each query's index among the keys
    lens = torch.cat([(qabs - p + 1).clamp(min=0) for p in pads])
    pos = None
    if ends is not None:  # a query that sees later keys: its keys to its end, its window from its position
        own = torch.cat([(qabs - p).clamp(min=-1) for p in pads])
        pos = torch.where(own >= 0, own, 0).contiguous()
        lens = torch.where(own >= 0, torch.cat([(ends[i].cpu() - p) for i, p in enumerate(pads)]), 0).contiguous()
    cpu_kernels.paged_attention(
        qt,
        k,
        v,
        table,
        rows,
        toks,
        lens,
        out,
        scale,
        softcap,
        window,
        chunk,
        sinks.to(torch.float32).contiguous() if sinks is not None else None,
        pos,
    )
    return out.view(b, q, h, d)


def _eager_attention(query, key, value, pads, ends, scale, softcap, window, chunk, sinks):
    """The same attention in ordinary torch ops (the backward's: autograd through it)."""
    q, s = query.shape[2], key.shape[2]
    qpos = torch.arange(s - q, s, device=query.device)[:, None]
    kpos = torch.arange(s, device=query.device)[None, :]
    allow = []
    for i, pad in enumerate(pads):
        end = qpos + 1 if ends is None else ends[i].to(query.device)[:, None]
        a = (kpos < end) & (kpos >= pad)
        if window:
            a &= qpos - kpos < window
        if chunk:
            a &= (kpos - pad) // chunk == (qpos - pad) // chunk
        allow.append(a)
    return masked_attention(query, key, value, torch.stack(allow), scale, softcap, sinks)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, sinks, pads, ends, scale, softcap, window, chunk):
        ctx.save_for_backward(query, key, value, sinks)
        ctx.args = (pads, ends, scale, softcap, window, chunk)
        if query.is_cuda or KERNEL:  # the Triton decode kernel, as the Triton backend's fixed-order form
            from acb.runner.batch_invariant_kernels import whole_sequence_attention

            if ends is not None:
                raise ValueError(
                    "acb's batch-invariant attention on CUDA computes causal attention only: image tokens that "
                    "attend to each other both ways are CPU-checked only"
                )

            sinks_c = sinks.contiguous() if sinks is not None else None
            out = whole_sequence_attention(query, key, value, pads, scale, softcap, window, chunk, sinks_c)
            return out.to(query.dtype)
        return _kernel_attention(query, key, value, pads, ends, scale, softcap, window, chunk, sinks).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        query, key, value, sinks = ctx.saved_tensors
        pads, ends, scale, softcap, window, chunk = ctx.args
        with torch.enable_grad():
            ins = [
                t.detach().requires_grad_(need) if t is not None else None
                for t, need in zip((query, key, value, sinks), ctx.needs_input_grad[:4])
            ]
            out = _eager_attention(ins[0], ins[1], ins[2], pads, ends, scale, softcap, window, chunk, ins[3])
            wrt = [t for t, need in zip(ins, ctx.needs_input_grad[:4]) if t is not None and need]
            grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True)) if wrt else iter(())
        res = [next(grads) if t is not None and need else None for t, need in zip(ins, ctx.needs_input_grad[:4])]
        return (*res, None, None, None, None, None, None)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function (:data:`ATTN_IMPL_NAME`): acb's fixed-order kernel over
    the whole sequences, as an engine in the mode computes each query (float32 CPU)."""
    from acb.runner.attention import layer_chunk, layer_sinks

    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"acb's batch-invariant attention runs on CPU or CUDA tensors, not {query.device.type}")
    if dropout and module.training:
        raise ValueError("acb's batch-invariant attention has no dropout (set the model's attention dropout to 0)")
    from acb.runner.batch_invariant_unpaged import is_unpaged

    if is_unpaged(module):  # keys and masks of its own (acb.runner.batch_invariant_unpaged)
        from acb.runner.batch_invariant_unpaged import attention_forward as unpaged_attention

        return unpaged_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, **kwargs)
    if kwargs.get("indices") is not None:  # indexed sparse attention's selection (acb.runner.batch_invariant_dsa)
        from acb.runner.batch_invariant_dsa import indexed_attention_forward

        return indexed_attention_forward(
            module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs
        )
    b, _, q, d = query.shape
    s = key.shape[2]
    chunk = layer_chunk(module)
    pads, ends = mask_ranges(attention_mask, b, q, s, sliding_window, chunk)
    scale = scaling if scaling is not None else d**-0.5
    k_dim, v_dim = key.shape[-1], value.shape[-1]
    if k_dim != v_dim:  # MLA's expanded heads: both at the wider width, as the engine's cache holds them
        width = max(k_dim, v_dim)
        query, key = (torch.nn.functional.pad(t, (0, width - k_dim)) for t in (query, key))
        value = torch.nn.functional.pad(value, (0, width - v_dim))
    out = _Attention.apply(query, key, value, layer_sinks(kwargs), pads, ends, scale, softcap, sliding_window, chunk)
    return (out if k_dim == v_dim else out[..., :v_dim]), None


def register_with_transformers() -> None:
    """Register :func:`attention_forward` (with transformers' SDPA mask) as :data:`ATTN_IMPL_NAME`
    (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPL_NAME, sdpa_mask)


class _AttentionOn:
    """A model's attention set to :data:`ATTN_IMPL_NAME` for a block, its own back after. A model
    an acb engine holds keeps the engine's attention (its steps may run meanwhile, on the engine
    thread): what its calls outside a step run, the "own" implementation the engine recorded, is
    set to ours for the block instead."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.own: str | None = None
        self.held: list[tuple[Any, str]] = []  # (config, its recorded own implementation): an engine's model

    def __enter__(self) -> None:
        from acb.runner.attention import ATTN_IMPL_NAME as ENGINE_ATTN
        from acb.runner.attention import own_implementation, set_own_implementation

        register_with_transformers()
        cfg = getattr(self.model, "config", None)
        if cfg is None:
            raise ValueError("enabled(model): the model has no transformers config")
        if cfg._attn_implementation == ENGINE_ATTN:
            configs = {id(c): c for c in [cfg, *(getattr(m, "config", None) for m in self.model.modules())]}
            for c in configs.values():
                own = own_implementation(c) if c is not None else None
                if own is not None:
                    self.held.append((c, own))
                    set_own_implementation([c], ATTN_IMPL_NAME)
            return
        from acb.runner.batch_invariant_families import text_attention_of

        self.own = text_attention_of(self.model)  # (a VLM's vision tower keeps its own)
        if self.own != ATTN_IMPL_NAME:
            _set_attn(self.model, ATTN_IMPL_NAME)

    def __exit__(self, *exc: object) -> None:
        from acb.runner.attention import set_own_implementation

        for c, own in self.held:
            set_own_implementation([c], own)
        self.held = []
        if self.own is not None and self.own != ATTN_IMPL_NAME:
            _set_attn(self.model, self.own)


def _set_attn(model: Any, impl: str) -> None:
    try:
        from acb.runner.batch_invariant_families import text_attention

        model.set_attn_implementation(text_attention(model, impl))
    except (AttributeError, ValueError, KeyError, ImportError):
        model.config._attn_implementation = impl


# ---------------------------------------------------------------- what the mode covers


def check_linear(shapes: list[tuple[int, int]], threads: tuple[int, ...] = (1, 2)) -> str | None:
    """Measure :func:`linear` here: a row alone, among 2, 3 and 67 rows, at each thread count,
    for each ``(in_features, out_features)``; None when every case gives the same bits, else
    the first that did not."""
    g = torch.Generator().manual_seed(0)
    was = torch.get_num_threads()
    try:
        for k, n in shapes:
            w = torch.randn(n, k, generator=g)
            x0 = torch.randn(1, k, generator=g)
            torch.set_num_threads(threads[0])
            ref = _fixed_linear(x0, w, None)[0]
            for th in threads:
                torch.set_num_threads(th)
                for m in (1, 2, 3, 67):
                    x = torch.randn(m, k, generator=g)
                    x[m // 2] = x0[0]
                    if not torch.equal(_fixed_linear(x, w, None)[m // 2], ref):
                        return f"a [{m}, {k}] x [{k}, {n}] linear at {th} threads computes a row in other bits"
    finally:
        torch.set_num_threads(was)
    return None


def attention_backend(device: torch.device) -> str:
    """The engine's attention backend in the mode: the Triton backend's fixed-order form on CUDA
    (and on CPU with :data:`KERNEL`, under the interpreter), else acb's CPU kernel."""
    return "triton" if device.type == "cuda" or KERNEL else "cpu"
