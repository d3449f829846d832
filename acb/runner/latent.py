"""Multi-head latent attention (MLA: DeepSeek V2/V3/V3.2, GLM-5, Kimi, MiniCPM3, ...) paged as its
latent: ``kv_lora_rank + qk_rope_head_dim`` values per token and layer, not the expanded heads.

transformers' MLA modules compute the latent (``kv_nope`` after ``kv_a_layernorm``, ``k_rot``
after RoPE), cache it, and expand the whole cached latent into per-head K/V with their own
``expand_kv(kv_nope, k_rot)`` right before the attention function. Within an engine step acb
replaces ``expand_kv`` on those modules (an instance attribute) with a pass-through, so acb's
attention function receives the latent (``key = kv_nope [1, 1, T, r]``, ``value = k_rot
[1, 1, T, rope]``). It stores ``[kv_nope | k_rot]`` in a key-only cache layer of shape
``(1, r + rope)`` (:class:`acb.runner.kv_cache.KVSpec` ``latent_layers``). The torch backend (and
the CPU backend, which hands these layers to it) and the Triton backend attend over the latent two
ways (``docs/design/layer-kinds.md`` §4):

- **B3, absorbed** (decode rows, and chunks after a cached prefix short enough that attending the
  latent per query costs less than expanding it: ``torch_backend.absorbs_chunk``). With ``W_UK``,
  ``W_UV`` the ``[H, nope, r]`` and ``[H, v, r]`` parts of ``kv_b_proj.weight`` viewed as
  ``[H, nope + v, r]``, the query ``[q_nope W_UK | q_rot]`` attends, with the model's scaling, over
  the latent as one head whose keys and values are both ``[c | k_rot]``; the heads are folded into
  the query length (one SDPA call, no head expanded), and the output's first ``r`` columns times
  ``W_UV^T`` are the heads' values for ``o_proj``. Per decode token this reads ``r + rope`` values
  per cached token and layer instead of expanding each one into ``H * (nope + v)``.
- **B1, expanded** (prefill chunks, and every query where B3 does not apply): gather the request's
  latent pages and call the module's *original* ``expand_kv`` on them, then SDPA (the values
  zero-padded to the keys' width, as the expanded cache stores them): ``model.generate``'s
  arithmetic.

B3 reassociates ``q . (W_UK c)`` as ``(W_UK^T q) . c`` (and likewise for V), so its float32 logits
differ from ``generate``'s in the last bits. It is kept because it is exact where it counts: the
greedy tokens of all 13 MLA families of the catalogue equal ``model.generate``'s on B3 as on B1
(``tests/api/test_mla_latent.py``, both paths; ``tests/runner/test_kind_latent.py`` at the layer,
allclose at 1e-5), and it is what makes decode over the latent cheaper than over expanded pages
(``benchmarks/mla_latent.py``). A module gets B3 only where a probe at engine start
(:func:`absorbable`) finds its ``expand_kv`` to be exactly that decomposition: no ``kv_b_proj``
bias (a bias would shift every key of a head equally and add once to the values; none of the
families has one), a plain floating-point weight of the expected shape, and K/V equal to the
decomposition's on random latents. Otherwise (and with :data:`ABSORB` off) the module keeps B1.
Attention sinks (Hunyuan V4) and the indexer's selection (DSA: V3.2, GLM-5, Hunyuan V4, AXK2)
apply on both paths: each folded query row keeps its head's sink and its token's selected keys.

acb's own CPU kernel could run B3 (one KV head, ``G = H``, the latent pages as both K and V), but the
torch path's one matrix product per row over the gathered latent measured 1.3-2.2x faster (one layer of
the benchmark's shape, 16 and 64 decode rows of 128 and 1,024 tokens, 1 and 2 threads), so the
CPU backend hands latent layers to it.

The modules are found by code: their class defines ``expand_kv`` and they have ``kv_b_proj``, an
int ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim`` and ``v_head_dim``. A module
without ``expand_kv`` (transformers before it) stays on the expanded path. The torch, CPU and Triton
backends attend over the latent (Triton: B3 by its latent kernel, ``triton_kernels.paged_latent_attention``,
the latent pages as one KV head for all ``H`` query heads, keys ``[c | k_rot]`` and values ``c``; B1 by
its prefill kernel over the expanded latent); flash-attn does not. Decode graphs and torch.compile are
off for these models.
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
    """How a latent layer's cached latent is attended.

    B1: ``expand(latent)`` with ``latent`` ``[B, 1, L, rank + rope]`` gives K ``[B, H, L, nope + rope]``
    and V ``[B, H, L, v_dim]`` (the module's own ``expand_kv``). B3 (``absorbs``): the query is
    ``[q_nope . W_UK | q_rot]`` (:meth:`absorb_query`) over the latent as one K = V head, and the
    output's first ``rank`` columns times ``W_UV^T`` are the heads' values (:meth:`unabsorb`)."""

    original: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    rope: int
    v_dim: int
    heads: int
    nope: int = 0
    # the module's kv_b_proj where B3 applies (its weight read at each call, so that weights updated or
    # replaced between steps are the ones used); None: B1 only
    kv_b: torch.nn.Linear | None = None

    def __call__(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.original(latent[..., : self.rank], latent[..., self.rank :])

    @property
    def absorbs(self) -> bool:
        return self.kv_b is not None

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv_b is not None
        w = self.kv_b.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, r], W_UV [H, v, r]

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` ``[H, T, nope + rope]`` (the module's query, ``[q_nope | q_rot]``) as ``[H, T, rank + rope]``
        against the latent: ``q_nope . k_nope = q_nope . (W_UK c) = (W_UK^T q_nope) . c``."""
        w_uk, _ = self._weights()
        return torch.cat([torch.bmm(q[..., : self.nope], w_uk.to(q.dtype)), q[..., self.nope :]], dim=-1)

    def unabsorb(self, o: torch.Tensor) -> torch.Tensor:
        """``o`` ``[T, H, >= rank]`` (attention over the latent as values) as the heads' values
        ``[T, H, v_dim]``: ``sum_j p_j (W_UV c_j) = W_UV sum_j p_j c_j``."""
        _, w_uv = self._weights()
        return torch.bmm(o[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2).to(o.dtype)).transpose(0, 1)


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


def absorbable(m: Any, original: Callable[..., Any]) -> bool:
    """Whether ``m``'s ``expand_kv`` (``original``) is what B3 assumes, checked on a few random latent
    tokens: K = ``[c W_UK^T | k_rot]`` per head and V = ``c W_UV^T``, ``W_UK`` and ``W_UV`` the
    ``[H, nope, r]`` and ``[H, v, r]`` parts of ``kv_b_proj.weight`` viewed as ``[H, nope + v, r]``,
    and no bias. A module that expands otherwise (or a quantized ``kv_b_proj``) keeps B1."""
    lin = m.kv_b_proj
    w = getattr(lin, "weight", None)
    rank, rope, nope, v = (int(m.kv_lora_rank), int(m.qk_rope_head_dim), int(m.qk_nope_head_dim), int(m.v_head_dim))
    if (
        getattr(lin, "bias", None) is not None
        or not isinstance(w, torch.Tensor)
        or not w.is_floating_point()
        or w.is_meta
        or w.dim() != 2
        or w.shape[1] != rank
        or w.shape[0] % (nope + v)
    ):
        return False
    heads = w.shape[0] // (nope + v)
    probe = LatentExpand(original, rank, rope, v, heads, nope, lin)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 3
    with torch.no_grad():
        c = torch.randn(1, 1, n, rank, generator=g).to(w.device, w.dtype)
        k_rot = torch.randn(1, 1, n, rope, generator=g).to(w.device, w.dtype)
        try:
            k, val = original(c, k_rot)
        except Exception:  # noqa: BLE001 (an expand_kv that cannot take this probe: B1, which calls it as the model does)
            return False
        if tuple(k.shape) != (1, heads, n, nope + rope) or tuple(val.shape) != (1, heads, n, v):
            return False
        # attention of each head's one query over the n keys, both ways
        q = torch.randn(heads, 1, nope + rope, generator=g).to(w.device, w.dtype)
        want = torch.softmax(q @ k[0].transpose(1, 2), -1) @ val[0]  # [H, 1, v]
        qa = probe.absorb_query(q)  # [H, 1, r + rope]
        lat = torch.cat([c, k_rot], -1)[0, 0]  # [n, r + rope]
        got = probe.unabsorb((torch.softmax(qa @ lat.T, -1) @ lat).transpose(0, 1)).transpose(0, 1)
    tol = 1e-3 if w.dtype == torch.float32 else 5e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


# B3 for the decode rows (and the CPU kernel's short chunks) where the module passes absorbable(); False
# keeps B1 everywhere (the benchmark's and the tests' switch, read when an engine starts)
ABSORB = True


class LatentLayers:
    """``expand_kv`` of the model's MLA modules replaced by a pass-through within engine steps (for an
    engine's life), and each module's original kept for acb's attention (:data:`LATENT_ATTR`)."""

    def __init__(self, model: torch.nn.Module, absorb: bool | None = None) -> None:
        absorb = ABSORB if absorb is None else absorb
        self.modules: list[Any] = []
        for m in latent_modules(model).values():
            if LATENT_ATTR in vars(m):  # another engine on this model has it already
                continue
            original = m.expand_kv
            nope, v = int(m.qk_nope_head_dim), int(m.v_head_dim)
            heads = int(m.kv_b_proj.out_features) // (nope + v)
            kv_b = m.kv_b_proj if absorb and absorbable(m, original) else None
            setattr(
                m,
                LATENT_ATTR,
                LatentExpand(original, int(m.kv_lora_rank), int(m.qk_rope_head_dim), v, heads, nope, kv_b),
            )
            m.expand_kv = _passing(original)
            self.modules.append(m)

    def remove(self) -> None:
        for m in self.modules:
            for name in ("expand_kv", LATENT_ATTR):
                if name in vars(m):
                    delattr(m, name)
        self.modules = []
