"""Indexed sparse attention (DeepSeek Sparse Attention: DeepSeek V3.2, GLM-5 DSA, Hunyuan V4,
AXK2): the indexer's keys paged like K/V, and the interception that runs the model's own
indexer over a continuous batch.

An indexed-attention layer has an *indexer*: a small module that scores every cached token
against each query (its own projections, a key per token, ReLU'd head scores weighted per
head) and returns the top-k token positions the query may attend to; the layer's attention
then sees only those keys. transformers' indexer keeps its keys in the model's cache
(``past_key_values.update_indexer(k, layer_idx)`` appends and returns the whole sequence) and
assumes one padded batch.

acb keeps each indexer's keys in a key-only cache layer under the request's block table
(:class:`acb.runner.kv_cache.KVSpec` ``index_layers``), so prefix caching, copy-on-write for
``n > 1``, offload and preemption treat them as they treat K/V. Within an engine step, the
indexer's own forward runs once per request segment of the flattened batch, with a cache object
(:class:`_IndexCache`) whose ``update_indexer`` writes the segment's keys into the pages and
returns the request's keys so far, and a causal mask over them: what ``model.generate`` does
for that request alone, so the selection is the model's, tie-breaking included. The positions it
returns (relative to the request's first token, ``-1`` where a short row has fewer than k)
reach acb's attention function as the layer's ``indices`` argument, and the torch backend
attends to those keys only (:mod:`acb.runner.attention.torch_backend`).

Layers that reuse an earlier layer's selection (GLM-5's and Hunyuan V4's ``"shared"`` indexer
types) get it from the model's own code, unchanged. The indexers are found by what they do
(their class calls ``update_indexer`` on its cache), not by a list of names.

One Python loop over the batch's requests per indexer per step: the reference path (the torch
backend only; decode graphs and torch.compile are off for these models). A batched top-k over
paged keys (a Triton kernel) is the GPU path to add.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from acb.runner.intercept import Interception, call_arguments
from acb.runner.step import CURRENT, entered

# the cache method an indexer's own code calls to store its keys and read them back
INDEXER_INTERFACE = "update_indexer"

_SPEAKS: dict[type, bool] = {}


def _calls_update_indexer(cls: type) -> bool:
    known = _SPEAKS.get(cls)
    if known is None:
        fn = inspect.unwrap(cls.forward) if hasattr(cls, "forward") else None
        code = getattr(fn, "__code__", None)
        known = _SPEAKS[cls] = code is not None and INDEXER_INTERFACE in code.co_names
    return known


def indexer_modules(model: torch.nn.Module) -> list[Any]:
    """The model's indexers, in layer order: modules with a ``layer_idx`` whose own forward stores
    and reads its keys through the cache's ``update_indexer`` (empty for a model without)."""
    found: dict[int, Any] = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and _calls_update_indexer(type(m)):
            found[idx] = m
    return [found[i] for i in sorted(found)]


def index_key_dim(indexers: list[Any]) -> int:
    """The width of an indexer key (one per token, all indexers alike)."""
    dims = {_key_width(m) for m in indexers}
    if len(dims) != 1:
        raise ValueError(f"the model's indexers have keys of different widths {sorted(dims)}")
    return dims.pop()


def _key_width(indexer: Any) -> int:
    for name in ("index_head_dim", "head_dim"):
        value = getattr(indexer, name, None)
        if isinstance(value, int):
            return value
    wk = getattr(indexer, "wk", None)
    if isinstance(wk, torch.nn.Linear):
        return int(wk.out_features)
    raise ValueError(f"{type(indexer).__name__} does not say how wide its keys are (no index_head_dim or head_dim)")


@dataclass
class _Segment:
    lo: int  # first token in the flattened batch
    hi: int
    start: int  # tokens of the request already cached before this step
    blocks: torch.Tensor  # the request's pages that hold its context after this step


class _Step:
    __slots__ = ("cache", "slots", "segments")

    def __init__(self, cache: Any, slots: torch.Tensor, segments: list[_Segment]) -> None:
        self.cache = cache
        self.slots = slots
        self.segments = segments


@contextlib.contextmanager
def indexed_step(kv_cache: Any, batch: Any) -> Iterator[None]:
    """Within the block, the intercepted indexers of this thread's forward run per request of
    ``batch`` (the step's :class:`acb.runner.attention.BatchInputs`) over ``kv_cache``'s pages."""
    bs = kv_cache.block_size
    segments, lo = [], 0
    for i, (n, start) in enumerate(zip(batch.num_new, batch.start_pos)):
        segments.append(_Segment(lo, lo + n, start, batch.block_table[i, : -(-(start + n) // bs)]))
        lo += n
    with entered("index", _Step(kv_cache, batch.slot_mapping, segments)):
        yield


class _IndexCache:
    """transformers' indexer-cache interface over one request's paged indexer keys."""

    __slots__ = ("step", "seg")

    def __init__(self, step: _Step, seg: _Segment) -> None:
        self.step = step
        self.seg = seg

    def update_indexer(self, key: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Store the segment's keys (``[1, n, D]``); the request's keys so far, ``[1, ctx, D]``."""
        cache, seg = self.step.cache, self.seg
        layer = cache.spec.index_layer_of(layer_idx)
        flat = cache.flat_k(layer)  # [slots, 1, D]
        flat.index_copy_(0, self.step.slots[seg.lo : seg.hi], key[0, :, None, :].to(flat.dtype))
        if seg.start == 0:  # the whole context is this segment: its keys as computed
            return key
        ctx = seg.start + seg.hi - seg.lo
        pages = cache.k[layer].index_select(0, seg.blocks)  # [blocks, block_size, 1, D]
        return pages.view(1, -1, pages.shape[-1])[:, :ctx].to(key.dtype)


def _forward(original: Any, sig: inspect.Signature, module: Any, *args: Any, **kwargs: Any) -> Any:
    step: _Step | None = CURRENT.index
    if step is None:  # not an engine step: the indexer as it always was
        return original(*args, **kwargs)
    rest = call_arguments(sig, module, args, kwargs)
    hidden, q_resid = rest["hidden_states"], rest["q_resid"]
    cos, sin = rest["position_embeddings"]
    device = hidden.device
    outs: list[tuple[_Segment, torch.Tensor]] = []
    for seg in step.segments:
        n = seg.hi - seg.lo
        ctx = seg.start + n
        # the request's causal mask as model.generate gives its indexer: query i sees keys <= its position
        qpos = torch.arange(seg.start, ctx, device=device)[:, None]
        mask = (torch.arange(ctx, device=device)[None, :] <= qpos)[None]  # [1, n, ctx]
        kw = dict(rest)
        kw.update(
            hidden_states=hidden[:, seg.lo : seg.hi],
            q_resid=q_resid[:, seg.lo : seg.hi],
            position_embeddings=(cos[..., seg.lo : seg.hi, :], sin[..., seg.lo : seg.hi, :]),
            attention_mask=mask,
            past_key_values=_IndexCache(step, seg),
        )
        if "position_ids" in kw:  # unused by the indexers (kept for backward compatibility)
            kw["position_ids"] = None
        got = original(**kw)
        outs.append((seg, got[0]))
    width = max(idx.shape[-1] for _, idx in outs)
    total = hidden.shape[1]
    out = torch.full((1, total, width), -1, dtype=outs[0][1].dtype, device=device)
    for seg, idx in outs:
        out[0, seg.lo : seg.hi, : idx.shape[-1]] = idx
    return out  # [1, T, k]: each query's selected positions in its own request, -1 past a short row's


class IndexedLayers(Interception):
    """The interception of a model's indexers (installed for an engine's life)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(indexer_modules(model), _forward)


def allowed_keys(index: torch.Tensor, rows: torch.Tensor | slice, length: int) -> torch.Tensor:
    """``[R, length]`` bool: True at the key positions each of ``rows`` (query tokens of the step)
    selected (``index``: ``[1, T, k]`` positions, ``-1`` for none)."""
    sel = index[0, rows].long()  # [R, k]
    allowed = torch.zeros((sel.shape[0], length + 1), dtype=torch.bool, device=sel.device)
    allowed.scatter_(1, torch.where(sel < 0, length, sel.clamp(max=length)), True)
    return allowed[:, :length]
