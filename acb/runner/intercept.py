"""What acb's interceptions of a model's own modules share (state layers, indexers, layers on the
model's own cache): finding a module class by the cache methods its code calls, binding a call's
arguments by name, and replacing modules' ``forward`` for an engine's life."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

_NAMES: dict[type, frozenset[str]] = {}


def code_names(cls: type) -> frozenset[str]:
    """The global and attribute names the methods ``cls`` defines use (not those inherited from
    torch): a class calls ``cache.update_indexer(...)`` iff ``"update_indexer"`` is among them."""
    known = _NAMES.get(cls)
    if known is not None:
        return known
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for fn in vars(klass).values():
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None:
                names.update(code.co_names)
    _NAMES[cls] = frozenset(names)
    return _NAMES[cls]


def call_arguments(sig: inspect.Signature, module: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments after ``self``, by name (those of a ``**kwargs`` parameter among them)."""
    out: dict[str, Any] = {}
    for name, value in list(sig.bind(module, *args, **kwargs).arguments.items())[1:]:
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


# the instance attribute counting the engines that hold a module's interception, per handler
_HOLDERS = "_acb_interceptions"


class Interception:
    """Each module's ``forward`` replaced by ``handler(original, signature, module, *args,
    **kwargs)`` until :meth:`remove` (an instance attribute over the class's method).

    Two engines on one model install the same handler once: the handlers read the step context of
    the thread they run on (each engine steps on its own thread), so one wrapper serves both, and
    the module gets its own ``forward`` back when the last of them is removed. (A second wrapper
    over the first would take the first's step for its own and cut the batch twice.)"""

    def __init__(self, modules: Iterable[Any], handler: Callable[..., Any]) -> None:
        self.layers = list(modules)
        self.handler = handler
        for m in self.layers:
            holders: dict[Any, int] | None = vars(m).get(_HOLDERS)
            if holders is not None and handler in holders:
                holders[handler] += 1
                continue
            original = m.forward
            sig = inspect.signature(type(m).forward)
            m.forward = lambda *a, _o=original, _s=sig, _m=m, **k: handler(_o, _s, _m, *a, **k)
            if holders is None:
                holders = {}
                setattr(m, _HOLDERS, holders)
            holders[handler] = 1

    def remove(self) -> None:
        for m in self.layers:
            holders = vars(m).get(_HOLDERS)
            if holders is None or self.handler not in holders:
                continue
            holders[self.handler] -= 1
            if not holders[self.handler]:
                del holders[self.handler]
                if not holders:
                    delattr(m, _HOLDERS)
                    if "forward" in vars(m):
                        del m.forward
        self.layers = []
