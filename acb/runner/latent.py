"""Multi-head latent attention (MLA: DeepSeek V2/V3/V3.2, GLM-5, Kimi, MiniCPM3, ...) paged as its
latent: ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, not the expanded heads.

transformers' MLA modules compute the latent (``kv_nope`` after ``kv_a_layernorm``, ``k_rot``
after RoPE), cache it, and expand the whole cached latent into per-head K/V with their own
``expand_kv(kv_nope, k_rot)`` right before the attention function. Within an engine step acb
replaces ``expand_kv`` on those modules (an instance attribute) with a pass-through, so acb's
attention function receives the latent (``key = kv_nope [1, 1, T, r]``, ``value = k_rot
[1, 1, T, rope]``). It stores ``[kv_nope | k_rot]`` in a key-only cache layer of shape
``(1, r + rope)`` (:class:`acb.runner.kv_cache.KVSpec` ``latent_layers``), and at attention the
torch backend gathers the request's latent pages and calls the module's *original* ``expand_kv``
on them: ``model.generate``'s own arithmetic (B1 of ``docs/design/layer-kinds.md`` §4).

The modules are found by code: their class defines ``expand_kv`` and they have ``kv_b_proj``, an
int ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim`` and ``v_head_dim``. A module
without ``expand_kv`` (transformers before it) stays on the expanded path. Only the torch
backend (and the CPU backend, which hands these layers to it) attends over the latent; decode
graphs and torch.compile are off for these models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# the instance attribute acb's attention function reads: the module's original expand_kv, wrapped
LATENT_ATTR = "_acb_latent"


@dataclass(frozen=True)
class LatentExpand:
    """How a latent layer's cached latent becomes its K/V: ``expand(latent)`` with ``latent``
    ``[B, 1, L, rank + rope]`` gives K ``[B, H, L, nope + rope]`` and V ``[B, H, L, v_dim]``."""

    original: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    rope: int
    v_dim: int
    heads: int

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.original(latent[..., : self.rank], latent[..., self.rank :])


def _int(m: Any, name: str) -> int | None:
    v = getattr(m, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _defines_expand_kv(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            return False
        if "expand_kv" in vars(klass):
            return True
    return False


def is_latent_module(m: Any) -> bool:
    """Whether ``m`` is an MLA attention module acb can page as its latent."""
    return (
        isinstance(getattr(m, "layer_idx", None), int)
        and _defines_expand_kv(type(m))
        and isinstance(getattr(m, "kv_b_proj", None), torch.nn.Linear)
        and all(_int(m, n) for n in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    )


def latent_modules(model: torch.nn.Module) -> dict[int, Any]:
    """The model's MLA attention modules by layer index (empty for a model without)."""
    from acb.runner.model_support import decoder_of

    out: dict[int, Any] = {}
    for m in decoder_of(model).modules():
        if is_latent_module(m):
            out.setdefault(int(m.layer_idx), m)
    return out


def latent_width(m: Any) -> int:
    """Values per token of ``m``'s cached latent: ``kv_lora_rank + qk_rope_head_dim``."""
    return int(m.kv_lora_rank) + int(m.qk_rope_head_dim)


def _passing(original: Callable[..., Any]) -> Callable[..., Any]:
    from acb.runner.attention import in_step, on_own_attention

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if in_step() and not on_own_attention():  # acb's attention pages the latent itself
            return kv_nope, k_rot
        return original(kv_nope, k_rot)  # not an engine step: as the model always does

    return expand_kv


class LatentLayers:
    """``expand_kv`` of the model's MLA modules replaced by a pass-through within engine steps (for an
    engine's life), and each module's original kept for acb's attention (:data:`LATENT_ATTR`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[Any] = []
        for m in latent_modules(model).values():
            if LATENT_ATTR in vars(m):  # another engine on this model has it already
                continue
            original = m.expand_kv
            heads = int(m.kv_b_proj.out_features) // (int(m.qk_nope_head_dim) + int(m.v_head_dim))
            setattr(
                m,
                LATENT_ATTR,
                LatentExpand(original, int(m.kv_lora_rank), int(m.qk_rope_head_dim), int(m.v_head_dim), heads),
            )
            m.expand_kv = _passing(original)
            self.modules.append(m)

    def remove(self) -> None:
        for m in self.modules:
            for name in ("expand_kv", LATENT_ATTR):
                if name in vars(m):
                    delattr(m, name)
        self.modules = []
