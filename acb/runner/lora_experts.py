"""LoRA on a MoE's fused experts (PEFT's ``target_parameters``; issue 56).

PEFT's ``ParamWrapper`` adapts a 3-D expert parameter ``W [E, a, b]`` by folding its factors into
the weight before the experts module runs: ``torch.baddbmm(W, lhs, rhs, alpha=scaling)``. To give
exactly PEFT's numbers acb does the same: :class:`ExpertAdapters` intercepts each experts module an
adapter targets. In a step with rows of such an adapter it runs the module once on the rows no
expert adapter of that module covers (the base rows, and those of adapters that leave it alone),
with its own weights, and once per slot present whose adapter targets it, on that slot's rows, with
each targeted parameter swapped for the folded weight; each row is computed once, and the outputs
are put together in the step's row order. A step with no such row runs the module as it is.

Memory: the factors live on the device per slot (``lhs [E, a, r]``, ``rhs [E, r, b]``). The folded
weight is a temporary copy of the expert parameter, made per step and slot and dropped before the
next slot's is made: at most one slot's folded parameters of one module are alive at a time
(caching them per slot would cost the model's expert bytes per adapter). Both are priced in the
memory budget before the KV blocks are counted (:meth:`ExpertAdapters.reserved_bytes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from acb.errors import InvalidRequestError
from acb.lora import FIELD, LoraAdapter
from acb.runner.intercept import Interception, call_arguments
from acb.runner.step import CURRENT

# parameter name -> (lhs, rhs, scaling) (on the device once put)
Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def _expert_params(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s own 3-D parameters: those an adapter's ``target_parameters`` may name."""
    return [p for p in module._parameters.values() if p is not None and p.dim() == 3]


class ExpertAdapters:
    """The adapters' expert factors per experts module and slot, and the modules' interception."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.per_module: dict[torch.nn.Module, dict[int, Factors]] = {}
        self._interceptions: list[Interception] = []

    @staticmethod
    def reserved_bytes(model: torch.nn.Module, max_loras: int, max_rank: int, refused: Mapping[int, str]) -> int:
        """The device bytes expert adapters may take, priced before the KV blocks: the factors of
        ``max_loras`` slots at ``max_rank`` for every 3-D parameter of the model an adapter could
        target (``E * r * (a + b)`` values per ``W [E, a, b]``, in its dtype), and the transient
        folded copy once (the largest module's 3-D parameters: one slot's folds of one module are
        alive at a time)."""
        factors = fold = 0
        for mod in model.modules():
            if id(mod) in refused:
                continue
            params = _expert_params(mod)
            for p in params:
                e, a, b = p.shape
                factors += max_loras * e * max_rank * (a + b) * p.element_size()
            fold = max(fold, sum(p.nbytes for p in params))
        return factors + fold

    @property
    def nbytes(self) -> int:
        return sum(
            lhs.nbytes + rhs.nbytes
            for per_slot in self.per_module.values()
            for ps in per_slot.values()
            for lhs, rhs, _ in ps.values()
        )

    def check(self, adapter: LoraAdapter, refused: Mapping[int, str]) -> dict[torch.nn.Module, Factors]:
        """``adapter``'s expert factors by module (still on the host); raises before anything is
        written."""
        named = dict(self.model.named_modules())
        experts: dict[torch.nn.Module, Factors] = {}
        for key, (lhs, rhs, scale) in adapter.params.items():
            mpath, _, pname = key.rpartition(".")
            mod = named.get(mpath)
            p = mod._parameters.get(pname) if mod is not None else None
            if (
                mod is None
                or p is None
                or p.dim() != 3
                or (p.shape[0], p.shape[1], p.shape[2]) != (lhs.shape[0], lhs.shape[1], rhs.shape[2])
            ):
                raise InvalidRequestError(
                    f"LoRA adapter {adapter.name!r}: {key!r} is not a 3-D parameter of the engine's model "
                    "that its factors fit",
                    FIELD,
                )
            why = refused.get(id(mod))
            if why is not None:
                raise InvalidRequestError(
                    f"LoRA adapter {adapter.name!r}: {key!r} cannot take an adapter in acb yet: {why}", FIELD
                )
            experts.setdefault(mod, {})[pname] = (lhs, rhs, float(scale))
        return experts

    def put(self, slot: int, experts: dict[torch.nn.Module, Factors]) -> None:
        """Put :meth:`check`'s factors in ``slot`` on the device (after the slot was emptied: the
        old and new factors of a slot are not on the device at once)."""
        new = []
        for mod, ps in experts.items():
            if mod not in self.per_module:
                self.per_module[mod] = {}
                new.append(mod)
            self.per_module[mod][slot] = {
                p: (lhs.to(self.device), rhs.to(self.device), scale) for p, (lhs, rhs, scale) in ps.items()
            }
        if new:
            self._interceptions.append(Interception(new, _experts_forward))

    def remove(self, slot: int) -> None:
        for per_slot in self.per_module.values():
            per_slot.pop(slot, None)

    def close(self) -> None:
        for i in self._interceptions:
            i.remove()
        self._interceptions = []


def _experts_forward(original: Any, sig: inspect.Signature, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A MoE experts module some adapter targets with ``target_parameters``: the rows no expert
    adapter of it covers with its own weights, then each covered slot's rows with PEFT's folded
    weights; each row once."""
    step = CURRENT.lora  # acb.runner.lora.LoraStep, or None
    per_slot = step.layers.experts.per_module.get(module) if step is not None else None
    if not per_slot:
        return original(*args, **kwargs)
    rows = step.rows
    # (this module's factors of the slot, the slot's token indices), for each slot present that targets it
    covered = [
        (ps, rows.order[start : start + count]) for slot, start, count in rows.runs if (ps := per_slot.get(slot))
    ]
    if not covered:  # no row of this step has an adapter of this module: every row with its own weights
        return original(*args, **kwargs)
    bound = call_arguments(sig, module, args, kwargs)
    n = rows.num_tokens
    if any(isinstance(v, torch.Tensor) and v.shape[0] != n for v in bound.values()):
        raise RuntimeError(
            f"LoRA on {type(module).__name__} (target_parameters): its inputs do not have the step's {n} tokens "
            "as rows; acb applies adapters to experts that see every token of the step in batch order"
        )
    n_base = n - sum(int(idx.shape[0]) for _, idx in covered)  # (host values: no sync)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token indices, the module's output on them)
    if n_base:
        mask = torch.zeros(n, dtype=torch.int8, device=rows.order.device)
        for _, idx in covered:
            mask.index_fill_(0, idx, 1)
        # the uncovered rows, ascending (a stable sort of the 0/1 mask: no device sync, unlike nonzero)
        idx = torch.argsort(mask, stable=True)[:n_base]
        parts.append((idx, _run_rows(original, bound, idx)))
    for ps, idx in covered:
        saved = {p: module._parameters[p] for p in ps}
        try:
            for p, (lhs, rhs, scale) in ps.items():
                w = saved[p]
                assert w is not None
                with torch.autocast(device_type=w.device.type, enabled=False):
                    module._parameters[p] = torch.baddbmm(w, lhs, rhs, alpha=scale)  # type: ignore[assignment]
            o = _run_rows(original, bound, idx)
        finally:
            # the folded copies are dropped here, before the next slot's are made (one slot's alive at a time)
            module._parameters.update(saved)
        parts.append((idx, o))
    first = parts[0][1]
    out = first.new_empty((n, *first.shape[1:]))
    for idx, o in parts:
        out.index_copy_(0, idx, o.to(out.dtype))
    return out


def _run_rows(original: Any, bound: dict[str, Any], idx: torch.Tensor) -> torch.Tensor:
    """The experts module's own forward on the rows ``idx`` of its (bound) inputs."""
    o = original(**{k: v.index_select(0, idx) if isinstance(v, torch.Tensor) else v for k, v in bound.items()})
    if not isinstance(o, torch.Tensor) or o.shape[0] != idx.shape[0]:
        raise RuntimeError(
            "LoRA on an experts module (target_parameters): acb expects its output to be a tensor with a row per "
            f"input row, got {type(o).__name__}"
        )
    return o
