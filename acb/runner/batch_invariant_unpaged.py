"""The batch-invariant mode (:mod:`acb.runner.batch_invariant`) on the layers acb runs on the model's
own cache (DeepSeek V4's attention: :mod:`acb.runner.unpaged_layers`).

The engine already runs such a layer per request (each request segment of a step its own call
on its own cache), so a request's bits do not meet the other requests' there; what moves them is
how its prompt is cut into calls (chunked prefill: a call of 1, 7 or 60 tokens) and, against a
trainer, that a trainer's call holds the whole sequence (and, in a batch, other rows). Measured on
the tiny config, chunked prefill moved the logprobs (2e-6) through, inside the layer:

- **The attention.** The model's own (eager) attention multiplies a call's queries by its keys
  (the cache's sliding window, the new tokens, then the compressor's pooled entries) in batched
  products whose sums the BLAS shapes by the call's query and key counts. In the mode each query's
  keys are the ones its mask lets it see, gathered in their order (window keys by position, then
  the pooled entries by index) and attended by acb's CPU kernel (:func:`fixed_attention`: a query
  at a time, its sums in that order, the sinks as the model's), whose bits depend on the query and
  that list only. The pooled entries a query may see are read from its compressor's own
  ``block_bias`` (causality, and the indexer's top-k), caught as the compressor returns it
  (:func:`install`'s hooks): the mask the layer concatenates them onto is its own float mask in the
  engine and a boolean one in a trainer (where the layer's ``block_bias.to(bool)`` turns allowed
  into not), so the token part is read from the mask and the pooled part from the compressor.
- **The grouped output projection** (``torch.bmm`` over the call's tokens): a product per group by
  the mode's linear (each row its own bits, whatever the row count).
- **The indexer's scores** (a 4-D ``torch.matmul`` of the queries' heads by the pooled keys, then
  a sum over the heads: the sum's order follows the tensor's shape, as a reduction over a dimension
  of length 1 or more entries is vectorized another way): the products and every ``sum`` over one
  dimension inside the layer are added first to last by element-wise ops (:func:`fixed_matmul`,
  :func:`fixed_sum`), each element's order its own. The compressor's pooling (a softmax over each
  window's slots and a sum over them) is a sum over one dimension as well and takes the same form;
  and its softmax (along the window's slots, not the last dimension) gave a window other bits as
  the number of windows in the call changed (measured): it runs in a fixed form too
  (:func:`fixed_softmax`).
- **The indexer's top-k**: ReLU'd scores tie exactly (every head's term zero) and ``topk`` breaks
  ties by its algorithm and the row's width (the entries pooled so far in the engine, all of them,
  the later masked, in a trainer): a stable sort instead (:func:`fixed_topk`).

These forms are entered on a thread with the mode on only (:data:`acb.runner.batch_invariant_flag`),
inside the unpaged layers' forward (forward hooks) and through the model module's own
``eager_attention_forward`` (what the engine runs these layers with: routed, the model's own
elsewhere); a trainer's forward under ``enabled(model)`` reaches :func:`fixed_attention` from the mode's
transformers attention function (:func:`attention_forward`). Chunked prefill is covered: the
compressor's windows close in whichever call their last token comes, and each pooled entry is
the same sums whatever the call. A trainer's batch is right-padded (the compressor pools windows
counted from the call's first token, so a left-padded row's entries are not the engine's: refused
with the reason). float32 CPU only (on CUDA the mode refuses these models).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from acb.runner.batch_invariant_flag import is_on
from acb.runner.intercept import code_names
from acb.runner.unpaged_layers import COMPRESSOR_INTERFACE, find_unpaged_layers

# switch for showing what the fixed forms do (tests): False leaves the layers' own ops in the mode
FIXED = True

_EAGER = "eager_attention_forward"  # the model module's function the engine runs these layers' attention with
_MARK = "_acb_unpaged_fixed"  # an unpaged layer's attribute once install() has hooked it
_LOCK = threading.Lock()
_TLS = threading.local()  # .caught: {id(layer): (pooled entries, block_bias)}; .modes: entered layer forms


def _on() -> bool:
    return FIXED and is_on()


def _float_cpu(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


# ------------------------------------------------------------------ products and sums in one order


def fixed_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batch dimensions broadcast) with each output element's products added first to last
    over the contracted dimension, by element-wise ops: its bits depend on its own row and column
    only, whatever the shapes around them."""
    if b.dim() == 1 or a.dim() == 1:
        raise ValueError("fixed_matmul takes matrices (at least 2-D operands)")
    acc = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, a.shape[-1]):
        acc = acc + a[..., :, k : k + 1] * b[..., k : k + 1, :]
    return acc


def fixed_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dim)`` added first to last along ``dim`` by element-wise adds: each output element's
    order its own, whatever the tensor's other dimensions."""
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        return x.sum(dim, keepdim=keepdim)
    acc = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        acc = acc + x.select(dim, i)
    return acc.unsqueeze(dim) if keepdim else acc


def fixed_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.softmax(dim)`` with each slice's sum added first to last (:func:`fixed_sum`) and its
    exponentials by torch's vector code for every element
    (:func:`acb.runner.batch_invariant_families.vector_path`): an element's bits depend on its own
    slice only. (torch's softmax along a dimension other than the last gives a slice other bits
    as the tensor's other dimensions change: measured on the compressor's windows.)"""
    from acb.runner.batch_invariant_families import vector_path

    top = x.amax(dim, keepdim=True).detach()  # (exact in any order; the softmax does not move with it)
    e = vector_path(torch.exp, x - top)
    return e / fixed_sum(e, dim, keepdim=True)


def fixed_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True) -> Any:
    """``x.topk(k, dim, largest)`` as a stable sort: ties go to the earlier index, so the entries
    chosen depend on the row's own values only (an indexer's ReLU'd scores tie exactly where every
    head's term is zero, and ``topk`` breaks ties by its algorithm and the row's width; a trainer's
    row holds the later entries too, masked to ``-inf``, which sort last)."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` as a product per batch entry by the mode's linear (``F.linear``, routed to
    :func:`acb.runner.batch_invariant.linear` while the mode is on: each of ``a[g]``'s rows its own
    bits, whatever the row count)."""
    return torch.stack([F.linear(a[g], b[g].transpose(0, 1)) for g in range(a.shape[0])])


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_BMMS = {torch.bmm, torch.Tensor.bmm}
_SUMS = {torch.sum, torch.Tensor.sum}
_SOFTMAXES = {torch.softmax, torch.Tensor.softmax, F.softmax}
_TOPKS = {torch.topk, torch.Tensor.topk}


def _softmax_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A softmax call's ``dim`` and ``dtype`` (``F.softmax``'s third positional is ``_stacklevel``)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    at = 3 if func is F.softmax else 2
    dtype = args[at] if len(args) > at else kwargs.get("dtype")
    return dim, dtype


def _one_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return dim if isinstance(dim, int) else None


class _LayerForms(TorchFunctionMode):
    """Inside an unpaged layer's forward, float32 CPU: ``bmm`` by :func:`fixed_bmm`, ``matmul`` of
    matrices by :func:`fixed_matmul`, a ``sum`` over one dimension by :func:`fixed_sum`, a
    ``softmax`` by :func:`fixed_softmax`, a ``topk`` by :func:`fixed_topk`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BMMS and len(args) == 2 and not kwargs and _float_cpu(*args):
            return fixed_bmm(*args)
        if func in _MATMULS and len(args) == 2 and not kwargs and _float_cpu(*args):
            if args[0].dim() >= 2 and args[1].dim() >= 2:
                return fixed_matmul(*args)
        if func in _SUMS and args and _float_cpu(args[0]) and set(kwargs) <= {"dim", "keepdim"}:
            dim = _one_dim(args, kwargs)
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            if dim is not None and isinstance(keepdim, bool) and len(args) <= 3:
                return fixed_sum(args[0], dim, keepdim)
        if func in _TOPKS and args and _float_cpu(args[0]) and set(kwargs) <= {"k", "dim", "largest", "sorted"}:
            named = dict(zip(("k", "dim", "largest", "sorted"), args[1:]), **kwargs)
            if "k" in named:
                return fixed_topk(args[0], int(named["k"]), int(named.get("dim", -1)), bool(named.get("largest", True)))
        if func in _SOFTMAXES and args and _float_cpu(args[0]):
            dim, dtype = _softmax_args(func, args, kwargs)
            if isinstance(dim, int) and dtype in (None, torch.float32):
                return fixed_softmax(args[0], dim)
        return func(*args, **kwargs)


# ------------------------------------------------------------------ the attention


class _Attention(torch.autograd.Function):
    """Each query over its own gathered keys (``keys`` ``[R, M, D]``, the first ``lens[r]`` its
    own) by acb's CPU kernel; the backward recomputes it with ordinary torch ops."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor | None, lens, scale):
        from acb.runner.attention import cpu_kernels

        r, h, d = q.shape
        m = keys.shape[1]
        ctx.save_for_backward(q, keys, sinks)
        ctx.args = (lens, scale)
        out = torch.zeros(r, h, d, dtype=torch.float32)
        if r == 0 or m == 0:
            return out
        rows = torch.arange(r, dtype=torch.long)
        cpu_kernels.paged_attention(
            q.contiguous(),
            keys.reshape(r, m, 1, d).contiguous(),
            keys.reshape(r, m, 1, d).contiguous(),
            rows[:, None].contiguous(),
            rows,
            rows,
            lens.contiguous(),
            out,
            scale,
            None,
            None,
            None,
            sinks.to(torch.float32).contiguous() if sinks is not None else None,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        q, keys, sinks = ctx.saved_tensors
        lens, scale = ctx.args
        with torch.enable_grad():
            ins = [
                t.detach().requires_grad_(need) if t is not None else None
                for t, need in zip((q, keys, sinks), ctx.needs_input_grad[:3])
            ]
            out = _eager(ins[0], ins[1], ins[2], lens, scale)
            wrt = [t for t, need in zip(ins, ctx.needs_input_grad[:3]) if t is not None and need]
            grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True)) if wrt else iter(())
        res = [next(grads) if t is not None and need else None for t, need in zip(ins, ctx.needs_input_grad[:3])]
        return (*res, None, None)


def _eager(q, keys, sinks, lens, scale):
    """:class:`_Attention`'s computation in ordinary torch ops (its backward's)."""
    w = torch.einsum("rhd,rmd->rhm", q, keys) * scale
    own = torch.arange(keys.shape[1])[None, :] < lens[:, None]  # [R, M]
    w = w.masked_fill(~own[:, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1).expand(w.shape[0], -1, 1).to(w.dtype)
        p = torch.softmax(torch.cat([w, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.nan_to_num(torch.softmax(w, dim=-1))
    return torch.einsum("rhm,rmd->rhd", p, keys)


def fixed_attention(
    query: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, S, D]`` over the one shared key-and-value head ``kv``
    ``[B, 1, K, D]``, each query over the keys ``allowed`` ``[B, S, K]`` lets it see, gathered in
    key order and attended by acb's CPU kernel (per-head ``sinks`` as the model's: a logit in the
    softmax's denominator). Returns ``[B, S, H, D]`` (the layout the model's attention returns).
    Differentiable."""
    b, h, s, d = query.shape
    k = kv.shape[2]
    lens = allowed.sum(-1).reshape(-1).to(torch.long)  # [B*S]
    m = int(lens.max()) if lens.numel() else 0
    # each query's keys first, in key order (a stable sort of "not allowed")
    order = torch.argsort((~allowed).to(torch.int8), dim=-1, stable=True)[..., :m]  # [B, S, M]
    src = kv[:, 0].unsqueeze(1).expand(b, s, k, d)
    keys = src.gather(2, order.unsqueeze(-1).expand(b, s, m, d)).reshape(b * s, m, d)
    q = query.transpose(1, 2).reshape(b * s, h, d)
    out = _Attention.apply(q, keys, sinks, lens, float(scale))
    return out.view(b, s, h, d).to(query.dtype)


def _allowed(module: Any, mask: torch.Tensor | None, b: int, s: int, k: int, window: int | None) -> torch.Tensor:
    """Which of the ``k`` keys (the tokens', then the pooled entries the layer's compressor returned
    in this call) each of the ``s`` queries sees: the token part from the layer's mask (a boolean
    one: True sees; a float one: 0 sees; none: causal within ``window``, the queries the last
    ``s`` tokens), the pooled part from the compressor's ``block_bias`` (0 sees; none: every
    entry)."""
    caught = getattr(_TLS, "caught", {}).pop(id(module), None)
    pooled, bias = caught if caught is not None else (0, None)
    tokens = k - pooled
    if mask is None:
        qpos = torch.arange(tokens - s, tokens)[:, None]
        kpos = torch.arange(tokens)[None, :]
        sees = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
        tok = sees.expand(b, s, tokens)
    else:
        part = mask[:, 0, :, :tokens].expand(b, s, tokens)
        if part.dtype == torch.bool:
            tok = part
        else:
            tok = part == 0
            if not bool(((part == 0) | (part <= torch.finfo(part.dtype).min / 2)).all()):
                raise ValueError(
                    f"batch_invariant=True: {type(module).__name__}'s mask adds values other than 0 and -inf "
                    "(the mode's fixed attention takes a mask that only lets keys through or not)"
                )
        if tokens and not bool(tok[:, :, 0].any(dim=1).all()):  # (an engine's first key: its window's oldest)
            raise ValueError(
                f"batch_invariant=True: a left-padded row reached {type(module).__name__}, whose compressor pools "
                "windows counted from the call's first token (pads included), so its entries are not the engine's; "
                "pad on the right, or run one sequence a row"
            )
    if pooled == 0:
        return tok.contiguous()
    if bias is None:
        comp = torch.ones(b, s, pooled, dtype=torch.bool)
    else:
        comp = (bias[:, 0] == 0).expand(b, s, pooled)
    return torch.cat([tok, comp], dim=-1)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An unpaged layer's attention in the mode (the engine's call of the model's eager function,
    and a trainer's of the mode's transformers attention function): :func:`fixed_attention` over
    the keys its mask and its compressor let each query see. Keys and values are one tensor in
    these layers (DeepSeek V4 reads its one head as both)."""
    if not _float_cpu(query, key, value):
        raise ValueError("batch_invariant=True: DeepSeek V4's compressed attention's fixed form is float32 CPU only")
    if dropout and module.training:
        raise ValueError("acb's batch-invariant attention has no dropout (set the model's attention dropout to 0)")
    if key.shape[1] != 1 or not (key is value or torch.equal(key, value)):
        raise ValueError(
            f"batch_invariant=True: {type(module).__name__} attends with {key.shape[1]} key heads or values other "
            "than its keys; the mode's fixed form takes one head read as both"
        )
    b, _, s, d = query.shape
    allowed = _allowed(module, attention_mask, b, s, key.shape[2], sliding_window)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    scale = scaling if scaling is not None else d**-0.5
    return fixed_attention(query, key, allowed, scale, sinks), None


def is_unpaged(module: Any) -> bool:
    """Whether ``module`` is an unpaged layer :func:`install` has given its fixed forms."""
    return bool(getattr(module, _MARK, False))


# ------------------------------------------------------------------ installing the forms


def _routed(original: Callable[..., Any]) -> Callable[..., Any]:
    def eager_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        if _on() and is_unpaged(module) and _float_cpu(query):
            scaling = args[0] if args else kwargs.pop("scaling", None)
            dropout = args[1] if len(args) > 1 else kwargs.pop("dropout", 0.0)
            return attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    eager_attention_forward.acb_fixed = True  # type: ignore[attr-defined]
    return eager_attention_forward


def _pre(module: torch.nn.Module, args: Any) -> None:
    stack = getattr(_TLS, "modes", None)
    if stack is None:
        stack = _TLS.modes = []
    if is_on():
        getattr(_TLS, "caught", {}).pop(id(module), None)
    if _on():
        mode = _LayerForms()
        mode.__enter__()
        stack.append(mode)
    else:
        stack.append(None)


def _post(module: torch.nn.Module, args: Any, output: Any) -> None:
    mode = _TLS.modes.pop()
    if mode is not None:
        mode.__exit__(None, None, None)


def _catch(layer: torch.nn.Module) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_on() and isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
            caught = getattr(_TLS, "caught", None)
            if caught is None:
                caught = _TLS.caught = {}
            caught[id(layer)] = (int(output[0].shape[2]), output[1])

    return hook


def compressor_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's child that pools its compressed entries (its class calls the cache's
    ``update_compressor_states``), or None (a sliding-only layer)."""
    return next((c for c in layer.children() if COMPRESSOR_INTERFACE in code_names(type(c))), None)


def install(model: torch.nn.Module) -> None:
    """Give ``model``'s unpaged layers their fixed forms on threads with the mode on (idempotent;
    elsewhere the layers run their own ops): hooks on each layer (its products and sums) and on
    its compressor (the pooled entries' mask, for the attention), and the layers' model module's
    ``eager_attention_forward`` routed to :func:`attention_forward`."""
    for layer in find_unpaged_layers(model):
        with _LOCK:
            mod = sys.modules[type(layer).__module__]
            own = getattr(mod, _EAGER, None)
            if own is not None and not getattr(own, "acb_fixed", False):
                setattr(mod, _EAGER, _routed(own))
            if getattr(layer, _MARK, False):
                continue
            layer.register_forward_pre_hook(_pre)
            layer.register_forward_hook(_post, always_call=True)
            comp = compressor_of(layer)
            if comp is not None:
                comp.register_forward_hook(_catch(layer))
            setattr(layer, _MARK, True)


def unpaged_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run ``model``'s unpaged layers (None: it can, and their fixed forms are
    installed: :func:`install`, routed only on threads with the mode on)."""
    from acb.runner.attention import own_implementation

    layers = find_unpaged_layers(model)
    p = next(model.parameters(), None)
    if p is not None and p.device.type != "cpu":
        return "on CUDA, DeepSeek V4's compressed attention (unpaged layers): its fixed forms are float32 CPU only"
    config: Any = model.config
    cfg: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
    own = own_implementation(cfg) or own_implementation(config) or cfg._attn_implementation
    if own not in (None, "eager"):
        return (
            f"unpaged layers ({type(layers[0]).__name__}) with attention {own!r}: the mode's fixed form replaces "
            "the model's eager attention (load the model with attn_implementation='eager')"
        )
    for layer in layers:
        if getattr(sys.modules[type(layer).__module__], _EAGER, None) is None:
            return f"unpaged layers ({type(layer).__name__}): its model module has no {_EAGER} for the mode to route"
    install(model)
    return None
