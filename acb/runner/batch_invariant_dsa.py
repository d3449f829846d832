"""The batch-invariant mode on indexed sparse attention (DSA: DeepSeek V3.2, GLM-5, AXK2, Hunyuan
V4): see :mod:`acb.runner.batch_invariant` and :mod:`acb.runner.indexed`.

Three things would move a request's bits with what else is in its step, or with how its prompt
was chunked:

- **The indexer's scores.** The model's indexer scores a query against the keys with two batched
  products (``torch.matmul``: the heads' ``q . k``, then the heads' weighted sum), whose sums
  the BLAS splits by the call's shape (the queries of a chunk, the keys of its context, the
  padded batch of a trainer). In the mode the indexer's own forward runs with those products in
  one fixed form (:func:`fixed_matmul`: each output element the contracted dimension's
  products added one after another, first to last, by element-wise ops whose bits do not depend
  on the tensor's shape): a (query, key) score is the same bits whatever the call.
- **The top-k.** A ReLU'd score ties exactly (every head's term zero), and ``topk`` breaks ties
  by the row's width and its algorithm's choice. In the mode the selection is a stable sort
  (:func:`fixed_topk`: value descending, ties to the earlier key), so the keys chosen depend on
  the query's own scores only; masked keys (``-inf``) come last, whatever the row's width.
- **The attention over the selected keys.** The torch backend folds the selection into a mask
  and runs SDPA over the whole context (blocked sums shaped by the call). In the mode each
  query's selected keys (those at or before its own position) are gathered in position order
  and attended by acb's CPU kernel (:func:`paged_indexed_attention`: the sums in position order,
  a query at a time), and a trainer's forward does the same over its whole sequences
  (:func:`indexed_attention_forward`, reached from the mode's transformers attention function
  when the model passes ``indices``).

Both sides enter the indexer's fixed form on a thread with the mode on: the engine in
:mod:`acb.runner.indexed` (each segment's call), a trainer through forward hooks on the
model's indexers that :func:`install` puts there once (``enabled(model)`` calls it). The fixed
forms are float32 CPU; on CUDA the mode refuses these models.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from acb.runner.batch_invariant_flag import is_on
from acb.runner.batch_invariant_masks import masked_attention

# switches for showing what the fixed forms do (tests): False runs, in the mode, the indexer's own
# products and top-k (FIXED_INDEXER), the torch backend's masked SDPA over the selection (FIXED_ATTENTION)
FIXED_INDEXER = True
FIXED_ATTENTION = True

_LOCK = threading.Lock()
_HOOKED = "_acb_dsa_fixed"  # the indexer module's attribute once install() has hooked it


def dsa_refusal(model: torch.nn.Module, indexers: list[Any]) -> str | None:
    """Why the mode cannot run ``model``'s indexed sparse attention layers (its ``indexers``:
    :func:`acb.runner.indexed.indexer_modules`, which imports this module) (None: it can)."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type != "cpu":
        return (
            f"indexed sparse attention (DSA) on {p.device.type}: the indexer's fixed products and top-k and the "
            "selected keys' fixed-order attention are float32 CPU only (the Triton kernels take no selection)"
        )
    for m in indexers:
        names = set(getattr(getattr(inspect.unwrap(type(m).forward), "__code__", None), "co_names", ()))
        if not {"matmul", "topk"} <= names:
            return (
                f"indexed sparse attention: {type(m).__name__}'s forward scores or selects by other ops than "
                "torch.matmul and topk, which the mode's fixed forms take"
            )
    return None


# ---------------------------------------------------------------- the indexer's fixed form


# the products a fixed_matmul call holds at once (elements): its rows are taken this many at a time
CHUNK_ELEMENTS = 1 << 23


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` summed over ``dim`` in a fixed pairwise order (halves added, an odd one's last carried),
    by element-wise adds: each result the same bits whatever else the tensor holds."""
    while x.shape[dim] > 1:
        k = x.shape[dim]
        h = k // 2
        top = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
        x = torch.cat([top, x.narrow(dim, 2 * h, 1)], dim) if k % 2 else top
    return x.squeeze(dim)


def fixed_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` (both at least 2-D, broadcast batch dimensions) with each output
    element the sum of its ``K`` products in one fixed pairwise order (:func:`_tree_sum`), by
    element-wise multiplies and adds (IEEE-rounded per element, whatever the tensor's shape, the
    other rows or the thread count). Rows are taken a slice at a time (:data:`CHUNK_ELEMENTS`)."""
    k = a.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"fixed_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n, m = a.shape[-2], b.shape[-1]
    per_row = max(1, k * m * max(1, batch.numel()))
    step = max(1, CHUNK_ELEMENTS // per_row)
    bt = b.unsqueeze(-3)  # [..., 1, K, m]
    outs = [_tree_sum(a[..., r : r + step, :, None] * bt, -2) for r in range(0, n, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def fixed_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    """``torch.topk`` by a stable sort: ties go to the earlier index, and the chosen indices of a
    row depend on its values only (not on how wide it is past them, when what lies past is lower)."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class FixedIndexerOps(TorchFunctionMode):
    """Within the block, ``torch.matmul`` on floating tensors of 2+ dimensions is :func:`fixed_matmul`
    and ``topk`` is :func:`fixed_topk` (entered around an indexer's own forward only)."""

    _MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
    _TOPK = (torch.topk, torch.Tensor.topk)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._MATMUL and not kwargs and len(args) == 2:
            a, b = args
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dim() >= 2
                and b.dim() >= 2
                and a.is_floating_point()
                and a.dtype == b.dtype
            ):
                return fixed_matmul(a, b)
        if func in self._TOPK:
            return fixed_topk(*args, **kwargs)
        return func(*args, **kwargs)


def indexer_ops() -> FixedIndexerOps | None:
    """The indexer's fixed form for a call on this thread (None: the mode is off, or :data:`FIXED_INDEXER` is)."""
    return FixedIndexerOps() if FIXED_INDEXER and is_on() else None


_HOOK_TLS = threading.local()  # .stack: the fixed forms the hooks entered on this thread, innermost last


def _pre(module: Any, args: Any, kwargs: Any) -> None:
    ops = indexer_ops()
    stack = getattr(_HOOK_TLS, "stack", None)
    if stack is None:
        stack = _HOOK_TLS.stack = []
    stack.append(ops)
    if ops is not None:
        ops.__enter__()


def _post(module: Any, args: Any, kwargs: Any, out: Any) -> None:
    stack = getattr(_HOOK_TLS, "stack", None)
    ops = stack.pop() if stack else None
    if ops is not None:
        ops.__exit__(None, None, None)


def install(indexers: list[Any]) -> None:
    """Hook a model's ``indexers`` (:func:`acb.runner.indexed.indexer_modules`; once per module;
    idempotent): on a thread with the mode on, their forward runs with :class:`FixedIndexerOps` (a
    trainer's forward under ``enabled(model)``); elsewhere the hooks do nothing."""
    with _LOCK:
        for m in indexers:
            if getattr(m, _HOOKED, False):
                continue
            m.register_forward_pre_hook(_pre, with_kwargs=True)
            m.register_forward_hook(_post, with_kwargs=True, always_call=True)
            setattr(m, _HOOKED, True)


# ---------------------------------------------------------------- attention over the selection


def _kernel(
    q: torch.Tensor,  # [T, H, D] (D contiguous)
    k: torch.Tensor,  # [R, n, KVH, D]: each query's selected keys in position order, zero-padded
    v: torch.Tensor,
    toks: torch.Tensor,  # [R] each query's token in q / out
    counts: torch.Tensor,  # [R] its selected keys
    out: torch.Tensor,  # [T, H, D]
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    from acb.runner.attention import cpu_kernels

    r = toks.numel()
    ar = torch.arange(r, dtype=torch.long)
    cpu_kernels.paged_attention(
        q,
        k.contiguous(),
        v.contiguous(),
        ar[:, None].contiguous(),
        ar,
        toks.to(torch.long).contiguous(),
        counts.to(torch.long).contiguous(),
        out,
        scale,
        softcap,
        None,
        None,
        sinks.to(torch.float32).contiguous() if sinks is not None else None,
    )


def _in_order(sel: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's selected positions ``sel`` ``[R, k]`` that lie in ``[lo, hi)`` (per row), in
    ascending order and each once: ``(positions [R, k] (past a row's count: lo), valid [R, k], counts [R])``."""
    sel = sel.long()
    ok = (sel >= lo[:, None]) & (sel < hi[:, None])
    big = torch.iinfo(torch.long).max
    srt = torch.where(ok, sel, big).sort(dim=1).values
    dup = torch.zeros_like(ok)
    dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
    srt = torch.where(dup, big, srt).sort(dim=1).values  # (the top-k's positions are distinct already)
    valid = srt != big
    return torch.where(valid, srt, lo[:, None]), valid, valid.sum(1)


def paged_indexed_attention(
    md: Any,  # the step's TorchMetadata, its kernel_rows set (the CPU backend's fixed order)
    q: torch.Tensor,  # [H, T, D]
    k_pages: torch.Tensor,  # [blocks, P, KVH, D]
    v_pages: torch.Tensor,
    out: torch.Tensor,  # [T, H, Dv]
    la: Any,  # the layer's AttentionCall (its index: [1, T, k] positions in the request, -1 for none)
) -> None:
    """The engine's indexed attention in the mode: each query token over the keys its indexer
    selected (at or before its own position), gathered from the pages in position order, through
    acb's CPU kernel (the sums in position order, a query at a time)."""
    if md.kernel_rows is None:
        raise RuntimeError("batch_invariant=True: indexed attention needs the CPU backend's per-token rows")
    if la.sliding_window is not None or la.chunk is not None or la.latent is not None or la.media_blocks:
        raise RuntimeError(
            "batch_invariant=True: an indexed attention layer with a sliding window, an attention chunk, a "
            "paged latent or image blocks is not covered"
        )
    table, rows, toks, lens = md.kernel_rows
    p = k_pages.shape[1]
    pos, _, counts = _in_order(la.index[0, toks], torch.zeros_like(lens), lens)
    slots = table[rows[:, None], pos // p] * p + pos % p  # [R, k]
    kf = k_pages.view(-1, *k_pages.shape[2:])
    vf = v_pages.view(-1, *v_pages.shape[2:])
    d = q.shape[-1]
    if out.shape[-1] != d:
        raise RuntimeError("batch_invariant=True: indexed attention with values narrower than keys in the cache")
    scale = la.scaling if la.scaling is not None else d**-0.5
    _kernel(q.transpose(0, 1), kf[slots], vf[slots], toks, counts, out, scale, la.softcap, la.sinks)


def _selection_mask(indices: torch.Tensor, pads: list[int], s: int) -> torch.Tensor:
    """``[B, Q, S]`` bool: the keys each query attends (selected, causal, past its row's padding)."""
    b, q = indices.shape[:2]
    qpos = torch.arange(s - q, s)[None, :, None]
    kpos = torch.arange(s)[None, None, :]
    lo = torch.tensor(pads)[:, None, None]
    sel = torch.zeros(b, q, s + 1, dtype=torch.bool)
    idx = indices.long()
    sel.scatter_(2, torch.where((idx >= 0) & (idx < s), idx, s), True)
    return sel[..., :s] & (kpos <= qpos) & (kpos >= lo)


def _whole_sequences(query, key, value, allow, scale, softcap, sinks) -> torch.Tensor:
    """The kernel over whole sequences: each query's allowed keys (``allow`` ``[B, Q, S]``) in
    position order. ``[B, Q, H, D]``; queries with no key (padding) are zeros."""
    b, h, q, d = query.shape
    s = key.shape[2]
    flat = allow.reshape(b * q, s)
    live = flat.any(1)
    which = live.nonzero()[:, 0]
    kpos = torch.arange(s)[None, :].expand(which.numel(), s)
    pos = torch.where(flat[which], kpos, s).sort(dim=1).values  # allowed positions first, in order
    counts = flat[which].sum(1)
    width = max(int(counts.max()) if counts.numel() else 1, 1)
    pos = pos[:, :width].clamp(max=s - 1)
    bi = which // q
    k = key.transpose(1, 2).float()[bi[:, None], pos]  # [R, width, KVH, D]
    v = value.transpose(1, 2).float()[bi[:, None], pos]
    qt = query.transpose(1, 2).reshape(b * q, h, d).float().contiguous()
    out = torch.zeros(b * q, h, d, dtype=torch.float32)
    _kernel(qt, k, v, which, counts, out, scale, softcap, sinks)
    return out.view(b, q, h, d)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, sinks, allow, scale, softcap):
        ctx.save_for_backward(query, key, value, sinks, allow)
        ctx.args = (scale, softcap)
        return _whole_sequences(query, key, value, allow, scale, softcap, sinks).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        query, key, value, sinks, allow = ctx.saved_tensors
        scale, softcap = ctx.args
        with torch.enable_grad():
            ins: list[Any] = [
                t.detach().requires_grad_(need) if t is not None else None
                for t, need in zip((query, key, value, sinks), ctx.needs_input_grad[:4])
            ]
            out = masked_attention(ins[0], ins[1], ins[2], allow, scale, softcap, ins[3])
            wrt = [t for t, need in zip(ins, ctx.needs_input_grad[:4]) if t is not None and need]
            grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True)) if wrt else iter(())
        res = [next(grads) if t is not None and need else None for t, need in zip(ins, ctx.needs_input_grad[:4])]
        return (*res, None, None, None)


def indexed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, Dk]
    key: torch.Tensor,  # [B, KVH, S, Dk]
    value: torch.Tensor,  # [B, KVH, S, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """The mode's transformers attention (:data:`acb.runner.batch_invariant.ATTN_IMPL_NAME`) for a
    layer that passes its indexer's selection (``indices`` ``[B, Q, k]``): each query over its
    selected keys (causal, past its row's left padding) in position order through acb's CPU kernel,
    the keys and values at the wider width as the engine's cache holds MLA's expanded heads;
    backward through ordinary torch ops. What the engine computes for the request alone."""
    from acb.runner.attention import layer_chunk, layer_sinks
    from acb.runner.batch_invariant_masks import mask_ranges

    indices = kwargs["indices"]
    if query.device.type != "cpu":
        raise ValueError("acb's batch-invariant indexed attention runs on CPU tensors (float32)")
    if sliding_window or layer_chunk(module):
        raise ValueError("acb's batch-invariant indexed attention takes no sliding window or attention chunk")
    b, _, q, d = query.shape
    s = key.shape[2]
    found = mask_ranges(attention_mask, b, q, s, None, None)
    pads: list[int] = found[0] if isinstance(found, tuple) else found  # (a tuple where it also gives key ends)
    scale = scaling if scaling is not None else d**-0.5
    k_dim, v_dim = key.shape[-1], value.shape[-1]
    if k_dim != v_dim:  # MLA's expanded heads: both at the wider width, as the engine's cache holds them
        width = max(k_dim, v_dim)
        query, key = (torch.nn.functional.pad(t, (0, width - k_dim)) for t in (query, key))
        value = torch.nn.functional.pad(value, (0, width - v_dim))
    allow = _selection_mask(indices, pads, s)
    out = _Attention.apply(query, key, value, layer_sinks(kwargs), allow, scale, softcap)
    return (out if k_dim == v_dim else out[..., :v_dim]), None
