"""The batch-invariant mode's fixed forms for the matrix products a model computes itself, outside
``F.linear`` and transformers' attention interface: the older families acb runs on their own
cache objects (GPT-Neo's attention ``matmul``, GPT-1's ``Conv1D`` ``addmm``, ...), found by
:func:`needs_fixed_products` (the model cannot take an attention implementation: its attention is
its own code).

Inside :class:`FixedProducts` (float32 CPU):

- a product with a 2-D right operand (a weight: ``x @ W.T``, ``addmm(b, x, W)``) is the mode's
  fixed linear (``F.linear``: each row its own bits whatever the row count);
- any other product (``matmul``, ``bmm``, ``baddbmm``: attention's ``q @ k.T`` and ``p @ v``) is
  :func:`acb.runner.batch_invariant_unpaged.fixed_matmul` (each element's products added first to
  last over the contracted dimension): a query's score against a key is the same bits whatever
  else the call holds, and ``p @ v`` over a whole sequence adds the masked keys' zero products
  after the query's own keys, which leaves its bits as a decode call's;
- a softmax is :func:`acb.runner.batch_invariant_unpaged.fixed_softmax` (the row's sum first to
  last: a masked key's ``exp`` is an exact zero added at the end);
- ``F.scaled_dot_product_attention`` called by the model itself (Falcon) is those three in a row
  (:func:`fixed_sdpa`).

Slow (the products are element-wise passes over the contracted dimension): only the modules that
compute such products run them (:func:`install`), only on threads with the mode on. Whether a
family then holds is the own-cache path's start-up checks' to say
(:func:`acb.runner.batch_invariant_own.own_cache_refusal`)."""

from __future__ import annotations

import dis
import inspect
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from acb.runner.batch_invariant_flag import is_on
from acb.runner.batch_invariant_unpaged import fixed_matmul, fixed_softmax

_LOCK = threading.Lock()
_HOOKED = "_acb_fixed_products"
_TLS = threading.local()  # .modes: the entered forms, innermost last

_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_BMMS = {torch.bmm, torch.Tensor.bmm}
_ADDS = {torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm}
_SOFTMAXES = {torch.softmax, torch.Tensor.softmax, F.softmax}
PRODUCT_NAMES = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "scaled_dot_product_attention"})


def _float_cpu(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def fixed_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` by the fixed forms: a 2-D ``b`` (a weight) through ``F.linear``, else
    :func:`acb.runner.batch_invariant_unpaged.fixed_matmul`."""
    if b.dim() == 2:
        return F.linear(a, b.transpose(0, 1))
    return fixed_matmul(a, b)


class FixedProducts(TorchFunctionMode):
    """The products and softmaxes of the code inside, by the fixed forms (see the module)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS or func in _BMMS:
            if len(args) == 2 and not kwargs and _float_cpu(*args) and args[0].dim() >= 2 and args[1].dim() >= 2:
                return fixed_product(*args)
        elif func in _ADDS:  # input + alpha * (a @ b), scaled by beta (the operands by position or name)
            named = dict(kwargs)
            names = ("input", "batch1", "batch2") if "baddbmm" in func.__name__ else ("input", "mat1", "mat2")
            for name, value in zip(names, args):
                named[name] = value
            ops = [named.pop(n, None) for n in names]
            beta, alpha = named.pop("beta", 1), named.pop("alpha", 1)
            if not named and _float_cpu(*ops) and _scalar(beta) and _scalar(alpha) and len(args) <= 3:
                if ops[1].dim() >= 2 and ops[2].dim() >= 2:
                    out = fixed_product(ops[1], ops[2])
                    if alpha != 1:
                        out = out * alpha
                    return out if beta == 0 else out + (ops[0] if beta == 1 else ops[0] * beta)
        elif func is F.scaled_dot_product_attention:
            out = _sdpa(args, kwargs)
            if out is not None:
                return out
        elif func in _SOFTMAXES and args and _float_cpu(args[0]):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            at = 3 if func is F.softmax else 2
            dtype = args[at] if len(args) > at else kwargs.get("dtype")
            if isinstance(dim, int) and dtype in (None, torch.float32):
                return fixed_softmax(args[0], dim)
        return func(*args, **kwargs)


def fixed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (no dropout) by the fixed forms: the scores by
    :func:`acb.runner.batch_invariant_unpaged.fixed_matmul` times the scale, the mask (boolean:
    where it is False, ``-inf``; float: added; ``is_causal``: torch's upper-left causal mask),
    :func:`acb.runner.batch_invariant_unpaged.fixed_softmax`, then the values by ``fixed_matmul``."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    w = fixed_matmul(query, key.transpose(-2, -1)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if is_causal:
        lq, lk = query.shape[-2], key.shape[-2]
        w = w.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=w.device).tril(), float("-inf"))
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
    return fixed_matmul(fixed_softmax(w, -1), value)


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def _sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A ``scaled_dot_product_attention`` call by :func:`fixed_sdpa`, or None where it does not
    apply (dropout, not float32 CPU, an argument it does not know)."""
    named = dict(zip(_SDPA_NAMES, args), **kwargs)
    if set(named) - {*_SDPA_NAMES, "enable_gqa"} or named.get("dropout_p", 0.0):
        return None
    mask = named.get("attn_mask")
    if not _float_cpu(named["query"], named["key"], named["value"]):
        return None
    if mask is not None and not (mask.dtype == torch.bool or _float_cpu(mask)):
        return None
    return fixed_sdpa(
        named["query"],
        named["key"],
        named["value"],
        mask,
        bool(named.get("is_causal", False)),
        named.get("scale"),
        bool(named.get("enable_gqa", False)),
    )


def needs_fixed_products(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is its own code (transformers cannot set its attention
    implementation, and it supports no attention backend: acb runs it on its own cache objects):
    the mode then runs its modules' products by :class:`FixedProducts`. Decided
    from the model alone, so an engine and a trainer's ``enabled(model)`` decide alike."""
    can = getattr(model, "_can_set_attn_implementation", None)
    # (a model that supports attention backends is paged through acb's attention: never these forms)
    return callable(can) and not can() and not getattr(model, "_supports_attention_backend", False)


def _code_products(code: Any) -> bool:
    if PRODUCT_NAMES & set(code.co_names):
        return True
    if any(i.opname == "BINARY_OP" and i.argrepr in ("@", "@=") for i in dis.get_instructions(code)):
        return True
    return any(_code_products(c) for c in code.co_consts if inspect.iscode(c))


def _computes_products(cls: type) -> bool:
    """Whether a method ``cls`` defines (its forward, or a helper: CodeGen's ``_attn``) calls a
    matrix product by name or with ``@`` (torch's own classes are not read)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch"):
            continue
        for fn in vars(klass).values():
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None and _code_products(code):
                return True
    return False


def product_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose own code computes a matrix product, outermost only (a module inside one
    already found runs inside its forms)."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if _computes_products(type(m)):
            found.append(m)
            inside.update(id(c) for c in m.modules())
    return found


def _pre(module: torch.nn.Module, args: Any) -> None:
    if not is_on():
        return
    mode = FixedProducts()
    mode.__enter__()
    stack = getattr(_TLS, "modes", None)
    if stack is None:
        stack = _TLS.modes = []
    stack.append((module, mode))


def _post(module: torch.nn.Module, args: Any, output: Any) -> None:
    stack = getattr(_TLS, "modes", None)
    if stack and stack[-1][0] is module:
        stack.pop()[1].__exit__(None, None, None)


def install(model: torch.nn.Module) -> None:
    """Where :func:`needs_fixed_products`: hook ``model``'s :func:`product_modules` (once each,
    idempotent) so that, on a thread with the mode on, their forward runs inside
    :class:`FixedProducts`; elsewhere the hooks do nothing."""
    if not needs_fixed_products(model):
        return
    with _LOCK:
        for m in product_modules(model):
            if getattr(m, _HOOKED, False):
                continue
            m.register_forward_pre_hook(_pre)
            m.register_forward_hook(_post, always_call=True)
            setattr(m, _HOOKED, True)
