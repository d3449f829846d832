"""Whether a model's weights changed since a moment: the key that guards the prefix cache (K/V
computed with other weights must not be read) and the packed CPU linears (copies of the weights).

A weight changes in one of four ways, and the key sees each (and a fifth thing that changes what
the weights compute, PEFT's adapter state):

- **in place** (``p.add_``, ``load_state_dict`` copying into the parameters, a ``torch.optim``
  step): the parameters' version counters move;
- **its storage replaced** (``p.data = t``, ``model.to(...)``): the storage addresses move;
- **by a fused optimizer** (``AdamW(fused=True)``, transformers' Trainer default), which writes
  without bumping version counters: a global optimizer hook counts the steps whose parameter
  groups hold one of the model's parameters;
- **by another object** (``load_state_dict(..., assign=True)``, ``module.weight =
  nn.Parameter(...)``, a buffer assigned, a bias added where there was none, a ``del``, a write
  into a module's ``_parameters``, a new submodule): each parameter and buffer is held with the
  dict it sits in, and the check asks each dict whether it still holds that object; whatever is
  registered on one of the model's modules by name (an added bias, a new submodule) is reported
  by torch's global registration hooks, which note the dict, the name and the value it holds
  before the assignment lands, and that entry is watched the same way from then on;
- **a PEFT adapter switched** (``set_adapter``, ``disable_adapter()``, ``merge_adapter()`` /
  ``unmerge_adapter()``, and transformers' own ``enable_adapters``/``set_adapter``), which changes
  no parameter (a merge writes through ``.data``): the adapter layers (PEFT's tuner layers, found
  by their class, ``BaseTunerLayer``, without importing PEFT) are held, and the key holds each one's
  active adapters, disabled flag, merged adapters and LoRA scaling.

The check is one pass over the parameters and buffers (a dict lookup each, in C) plus the two
sums over the parameters, and a tuple of a few attributes per adapter layer (none without PEFT); it
runs on the engine thread before requests are admitted, not per
token. Not seen: in-place writes through ``.data`` outside an optimizer (``p.data.mul_(2)``: no
counter moves), and a submodule removed or replaced by a write into ``_modules`` itself (no
hook sees it); call ``reset_prefix_cache()`` after those.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook

WeightsKey = tuple[int, int, int, int, tuple[Any, ...]]
_VERSION = operator.attrgetter("_version")


class WeightWatch:
    """The key of a model's weights (:meth:`key`); changes whenever a weight does (see the module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizer_steps = 0  # written by the optimizer hook (the training thread)
        self.generation = 0  # how many times the objects were found replaced
        # (dict, name, value the hook saw): names registered on the model's modules since the last
        # check; list.append is atomic, so the hooks (any thread) and the check (the engine) share it
        self._registered: list[tuple[dict[str, Any], str, Any]] = []
        self._collect()
        self._handles: list[Any] = []

    def attach(self) -> None:
        """Register the global hooks (optimizer steps, names registered on the model's modules);
        :meth:`close` removes them."""
        ref = weakref.ref(self)
        self._handles = [
            register_optimizer_step_post_hook(_on_optimizer_step(ref)),
            register_module_parameter_registration_hook(_on_register(ref, "_parameters")),
            register_module_buffer_registration_hook(_on_register(ref, "_buffers")),
            register_module_module_registration_hook(_on_register(ref, "_modules")),
        ]

    def _collect(self) -> None:
        """Hold every parameter and buffer of the model with the dict it sits in (three parallel
        lists, so that the check runs in C: ``map(dict.get, ...)``)."""
        modules = list(self.model.modules())
        dicts: list[dict[str, Any]] = [d for m in modules for d in (m._parameters, m._buffers)]
        slots = [(d, name, value) for d in dicts for name, value in d.items()]
        self._dicts: list[dict[str, Any]] = [d for d, _, _ in slots]
        self._names = [name for _, name, _ in slots]
        self._values = [value for _, _, value in slots]
        self._collected = len(slots)
        self.params = list(self.model.parameters())
        self.param_ids = frozenset(id(p) for p in self.params)
        self._module_ids = frozenset(id(m) for m in modules)
        self._adapter_layers = [m for m in modules if _is_adapter_layer(m)]

    def _replaced(self) -> bool:
        """Whether an object was replaced, added or removed since :meth:`_collect` (re-collects then)."""
        pending = self._registered
        while pending:  # a registration noted (possibly not landed yet): watched from now on
            d, name, value = pending.pop()
            self._dicts.append(d)
            self._names.append(name)
            self._values.append(value)
        replaced = any(map(operator.is_not, map(dict.get, self._dicts, self._names), self._values))
        if replaced or len(self._dicts) > 2 * self._collected:  # (re-registrations of the same objects pile up)
            self._collect()
        return replaced

    def key(self) -> WeightsKey:
        """(sum of the parameters' version counters, sum of their storage addresses, optimizer
        steps on them, generation of the objects, the PEFT adapter layers' state): equal keys,
        unchanged weights."""
        if self._replaced():
            self.generation += 1
        params = self.params
        return (
            sum(map(_VERSION, params)),
            sum(map(torch.Tensor.data_ptr, params)),
            self.optimizer_steps,
            self.generation,
            tuple(map(_adapter_state, self._adapter_layers)),
        )

    def close(self) -> None:
        """Remove the global hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _is_adapter_layer(module: torch.nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, IA3, LoHa...: a subclass of PEFT's ``BaseTunerLayer``)."""
    return any(c.__name__ == "BaseTunerLayer" for c in type(module).__mro__)


def _adapter_state(layer: Any) -> tuple[Any, ...]:
    """What a PEFT tuner layer computes with besides its parameters: its active adapters, whether
    adapters are disabled, which are merged into the base weight, and (LoRA) their scaling. Copies:
    PEFT changes its lists and dicts in place. (About 0.5-1 us a layer on this CPU.)"""
    active = layer.active_adapter
    scaling = getattr(layer, "scaling", None)
    return (
        active if active.__class__ is str else tuple(active),
        layer.disable_adapters,
        tuple(layer.merged_adapters),
        tuple(scaling.items()) if scaling.__class__ is dict else None,
    )


def _on_optimizer_step(ref: weakref.ref[WeightWatch]) -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """A global optimizer post-step hook counting the steps that updated the watched weights."""

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        watch = ref()
        if watch is None:
            return
        ids = watch.param_ids
        if any(id(p) in ids for group in opt.param_groups for p in group["params"]):
            watch.optimizer_steps += 1

    return hook


def _on_register(ref: weakref.ref[WeightWatch], where: str) -> Callable[[torch.nn.Module, str, Any], None]:
    """A global registration hook noting a name registered on one of the watched modules, with the
    value its dict holds before the assignment lands (the check compares against it)."""

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        watch = ref()
        if watch is not None and id(module) in watch._module_ids:
            d = module.__dict__.get(where)
            if d is not None:
                watch._registered.append((d, name, d.get(name)))

    return hook
