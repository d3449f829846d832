"""LoRA on a MoE's fused experts (PEFT's ``target_parameters``; issue 56).

PEFT's ``ParamWrapper`` adapts a 3-D expert parameter ``W [E, a, b]`` by folding its factors into
the weight before the experts module runs: ``torch.baddbmm(W, lhs, rhs, alpha=scaling)``. To give
exactly PEFT's numbers acb does the same: :class:`ExpertAdapters` intercepts each experts module an
adapter targets; in a step with adapter rows it runs the module once on every row with its own
weights, then once per slot present whose adapter targets it, on that slot's rows, with each
targeted parameter swapped for the folded weight (made once per step and slot), and copies that
output over those rows. The factors live on the device per slot.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from acb.errors import InvalidRequestError
from acb.lora import FIELD, LoraAdapter
from acb.runner.intercept import Interception, call_arguments
from acb.runner.step import CURRENT

# parameter name -> (lhs, rhs, scaling) on the device
Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float]]


class ExpertAdapters:
    """The adapters' expert factors per experts module and slot, and the modules' interception."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.per_module: dict[torch.nn.Module, dict[int, Factors]] = {}
        self._interceptions: list[Interception] = []

    @property
    def nbytes(self) -> int:
        return sum(
            lhs.nbytes + rhs.nbytes
            for per_slot in self.per_module.values()
            for ps in per_slot.values()
            for lhs, rhs, _ in ps.values()
        )

    def check(self, adapter: LoraAdapter, refused: dict[int, str]) -> dict[torch.nn.Module, Factors]:
        """``adapter``'s expert factors by module, on the device; raises before anything is written."""
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
            experts.setdefault(mod, {})[pname] = (lhs.to(self.device), rhs.to(self.device), float(scale))
        return experts

    def put(self, slot: int, experts: dict[torch.nn.Module, Factors]) -> None:
        new = []
        for mod, ps in experts.items():
            if mod not in self.per_module:
                self.per_module[mod] = {}
                new.append(mod)
            self.per_module[mod][slot] = ps
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
    """A MoE experts module some adapter targets with ``target_parameters``: every row with the base
    weights, then each slot's rows again with PEFT's folded weights, copied over."""
    out = original(*args, **kwargs)
    step = CURRENT.lora  # acb.runner.lora.LoraStep, or None
    if step is None:
        return out
    per_slot = step.layers.experts.per_module.get(module)
    if not per_slot:
        return out
    bound = call_arguments(sig, module, args, kwargs)
    names = list(bound)
    rows = step.rows
    n = rows.num_tokens
    o2 = out.view(-1, out.shape[-1])
    if o2.shape[0] != n or any(isinstance(v, torch.Tensor) and v.shape[0] != n for v in bound.values()):
        raise RuntimeError(
            f"LoRA on {type(module).__name__} (target_parameters): its inputs do not have the step's {n} tokens "
            "as rows; acb applies adapters to experts that see every token of the step in batch order"
        )
    for slot, start, count in rows.runs:
        ps = per_slot.get(slot)
        if not ps:
            continue
        idx = rows.order[start : start + count]
        sub = {k: v.index_select(0, idx) if isinstance(v, torch.Tensor) else v for k, v in bound.items()}
        saved = {p: module._parameters[p] for p in ps}
        try:
            for p, (lhs, rhs, scale) in ps.items():
                w = saved[p]
                assert w is not None
                with torch.autocast(device_type=w.device.type, enabled=False):
                    module._parameters[p] = torch.baddbmm(w, lhs, rhs, alpha=scale)  # type: ignore[assignment]
            o = original(**{k: sub[k] for k in names})
        finally:
            module._parameters.update(saved)
        o2.index_copy_(0, idx, o.reshape(-1, o2.shape[-1]).to(o2.dtype))
    return out
