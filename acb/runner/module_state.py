"""State a model keeps in its modules' attributes, outside any cache object.

Some models carry a request's state from one forward to the next in plain attributes of their
modules instead of in the cache object ``model.generate`` hands them: RecurrentGemma's recurrent
blocks keep their convolution window in ``conv1d_state`` and their RG-LRU state in
``rg_lru.recurrent_states``, and re-zero both whenever the batch size changes. ``model.generate``
runs one batch at a time, so that is enough there; an engine that interleaves requests would run
each request on whatever the previous one left behind.

:func:`find_module_state` finds these attributes by what a forward does to them (an attribute that
is a tensor, or becomes one, and is replaced or written in place by a forward with a cache), not
by a list of models. :class:`ModuleState` then gives each request its own values: restored before
the request's forward, saved after it (:mod:`acb.runner.own_cache_runner` runs such a model one
request at a time). The paged path cannot do that within its one flattened forward, so a model
found with such state runs on its own cache objects (:func:`acb.runner.setup.check_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Slot = tuple[torch.nn.Module, str]
Values = tuple[Any, ...]


def module_attributes(model: torch.nn.Module) -> dict[Slot, Any]:
    """Every module's plain attributes that are tensors or None (parameters, buffers and
    submodules live in their own dicts, not in ``__dict__``)."""
    found: dict[Slot, Any] = {}
    for m in model.modules():
        for name, value in vars(m).items():
            if value is None or isinstance(value, torch.Tensor):
                found[(m, name)] = value
    return found


def find_module_state(model: torch.nn.Module, run: Callable[[], object]) -> list[Slot]:
    """The module attributes ``run`` (a forward of ``model`` with a cache) sets: tensors that
    appear, are replaced, or change in place. Empty for a model whose state is all in its cache."""
    before = module_attributes(model)
    copies = {slot: v.detach().clone() for slot, v in before.items() if isinstance(v, torch.Tensor)}
    run()
    after = module_attributes(model)
    changed = []
    for slot, value in after.items():
        if isinstance(value, torch.Tensor) and (before.get(slot) is not value or not _same(copies.get(slot), value)):
            changed.append(slot)
    return changed


def _same(a: torch.Tensor | None, b: Any) -> bool:
    return a is not None and a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.detach()))


def describe(slots: list[Slot], model: torch.nn.Module, limit: int = 3) -> str:
    """``slots`` by their dotted names (the first ``limit``), for a message."""
    names = {id(m): n for n, m in model.named_modules()}
    shown = [f"{names.get(id(m), '?')}.{attr}".lstrip(".") for m, attr in slots[:limit]]
    more = f" and {len(slots) - limit} more" if len(slots) > limit else ""
    return ", ".join(shown) + more


class ModuleState:
    """Per-request values of the module attributes :func:`find_module_state` found.

    ``fresh`` are the values before any engine forward (what a new request starts from, as a new
    ``model.generate`` call does); :meth:`restore` puts a request's values in place before its
    forward and :meth:`save` takes them after. A value written in place by the model is saved as a
    copy (the next request would write into the same tensor); a replaced one is kept as is.
    """

    def __init__(self, slots: list[Slot], fresh: Values, in_place: frozenset[int]) -> None:
        self.slots = slots
        self.fresh = fresh
        self.in_place = in_place  # indices of the slots the model writes into, not replaces

    @classmethod
    def of(
        cls, model: torch.nn.Module, run: Callable[[], object], start: dict[Slot, Any] | None = None
    ) -> ModuleState | None:
        """Runs ``run`` (a forward with a cache) and returns the state it showed, or None. ``start``:
        the attributes as the user's model had them (:func:`module_attributes` before the engine ran
        any forward, such as the one that measures a cache), else as they are now; the model is
        left with those values."""
        start = module_attributes(model) if start is None else start
        slots = find_module_state(model, run)
        if not slots:
            return None
        fresh = tuple(start.get(slot) for slot in slots)
        for slot, value in zip(slots, fresh):  # back to how the user's model was
            setattr(slot[0], slot[1], value)
        in_place = frozenset(i for i, v in enumerate(fresh) if isinstance(v, torch.Tensor))
        return cls(slots, tuple(_copy(v) for v in fresh), in_place)

    def restore(self, values: Values | None) -> None:
        """Put ``values`` (a request's, or None for a new request) in the modules."""
        for i, ((module, attr), value) in enumerate(zip(self.slots, self.fresh if values is None else values)):
            setattr(module, attr, _copy(value) if i in self.in_place or values is None else value)

    def save(self) -> Values:
        """The modules' values now (after a request's forward)."""
        return tuple(
            _copy(getattr(m, attr, None)) if i in self.in_place else getattr(m, attr, None)
            for i, (m, attr) in enumerate(self.slots)
        )

    @staticmethod
    def nbytes(values: Values) -> int:
        return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
