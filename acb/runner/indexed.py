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

The segments whose context is no longer than the indexer's top-k (every query selects all its
keys: most requests of a real DSA model, whose top-k is 2,048) go through the indexer in one call,
as ``model.generate`` runs a padded batch: right-padded, their keys gathered from their pages to
the longest context and masked per request (:class:`_BatchIndexCache`, :func:`_batch_call`). Longer
ones keep a call each: their scores tie exactly where a ReLU zeroes every head's term, and the
top-k breaks such ties by the row's width, so a padded row could select other keys than the
request alone (measured: the scores are bitwise equal, the picks among the zeros not). In the batch-invariant mode
(:mod:`acb.runner.batch_invariant_dsa`) the indexer's products and top-k take fixed forms (exact
per (query, key), ties to the earlier key), so every decode row shares the one call too, and the
selected keys are attended in position order by acb's CPU kernel. (The torch backend
only; decode graphs and torch.compile are off for these models. A batched top-k over paged keys, a
Triton kernel, is the GPU path to add.)
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


class _BatchIndexCache:
    """The same interface over several requests' segments at once (a padded batch): the
    segments' keys written into their pages, and each request's context gathered from its pages,
    ``[B, ctx_max, D]`` (zeros past a request's own length, which its mask leaves out)."""

    __slots__ = ("step", "segs", "table", "width")

    def __init__(self, step: _Step, segs: list[_Segment], width: int) -> None:
        self.step = step
        self.segs = segs
        self.width = width  # the longest request's context after the step
        cols = max(len(seg.blocks) for seg in segs)
        # the requests' pages, padded with the scratch block 0 (never read past a request's length)
        self.table = torch.stack([torch.nn.functional.pad(seg.blocks, (0, cols - len(seg.blocks))) for seg in segs])

    def update_indexer(self, key: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Store the segments' keys (``[B, n_max, D]``, padded); the requests' keys so far."""
        cache = self.step.cache
        layer = cache.spec.index_layer_of(layer_idx)
        flat = cache.flat_k(layer)  # [slots, 1, D]
        real = torch.cat([key[i, : seg.hi - seg.lo] for i, seg in enumerate(self.segs)])  # [tokens, D]
        slots = torch.cat([self.step.slots[seg.lo : seg.hi] for seg in self.segs])
        flat.index_copy_(0, slots, real[:, None, :].to(flat.dtype))
        pages = cache.k[layer][self.table]  # [B, cols, block_size, 1, D]
        return pages.view(len(self.segs), -1, pages.shape[-1])[:, : self.width].to(key.dtype)


# switch for A/B measurement: the segments that may share a call go through one (True), or each
# through its own (False)
BATCH_SEGMENTS = True


def _segment_call(original: Any, rest: dict[str, Any], step: _Step, seg: _Segment) -> torch.Tensor:
    """The indexer's own forward over one request's segment, with the request's causal mask."""
    hidden, q_resid = rest["hidden_states"], rest["q_resid"]
    cos, sin = rest["position_embeddings"]
    device = hidden.device
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
    return original(**kw)[0]  # [n, k]


def _batch_call(original: Any, rest: dict[str, Any], step: _Step, segs: list[_Segment]) -> torch.Tensor:
    """The indexer's own forward over several requests' segments in one call, as ``model.generate``
    runs a padded batch: the segments right-padded to the longest, each request's keys gathered to
    the longest context and every query masked as its request's causal mask (a pad query sees no
    key, and its selection is dropped). Only segments whose every query selects all its keys (its
    context is no longer than the indexer's top-k) share a call: their selection is the same set
    however the top-k breaks ties (scores of exactly equal value, which a ReLU'd score makes
    common), which a wider row would change. Positions the top-k returns past a query's own keys
    are -1, as a call of its own leaves them. ``[tokens of the segments, k]``, in their order."""
    hidden, q_resid = rest["hidden_states"], rest["q_resid"]
    cos, sin = rest["position_embeddings"]
    device = hidden.device
    n_max = max(seg.hi - seg.lo for seg in segs)
    # each padded query's token in the flattened step (a pad repeats its segment's last token)
    at = torch.tensor(
        [[seg.lo + min(j, seg.hi - seg.lo - 1) for j in range(n_max)] for seg in segs], device=device
    )  # [B, n_max]
    qpos = torch.tensor(
        [[seg.start + j if j < seg.hi - seg.lo else -1 for j in range(n_max)] for seg in segs], device=device
    )  # [B, n_max]: each query's position in its request, -1 for a pad
    width = max(seg.start + seg.hi - seg.lo for seg in segs)
    mask = torch.arange(width, device=device)[None, None, :] <= qpos[:, :, None]  # [B, n_max, ctx_max]
    kw = dict(rest)
    kw.update(
        hidden_states=hidden[0, at],
        q_resid=q_resid[0, at],
        position_embeddings=(cos[0, at], sin[0, at]),
        attention_mask=mask,
        past_key_values=_BatchIndexCache(step, segs, width),
    )
    if "position_ids" in kw:
        kw["position_ids"] = None
    idx = original(**kw)  # [B, n_max, k]
    idx = torch.where(idx <= qpos[:, :, None], idx, -1).to(idx.dtype)
    return torch.cat([idx[i, : seg.hi - seg.lo] for i, seg in enumerate(segs)])


def _forward(original: Any, sig: inspect.Signature, module: Any, *args: Any, **kwargs: Any) -> Any:
    step: _Step | None = CURRENT.index
    if step is None:  # not an engine step: the indexer as it always was
        return original(*args, **kwargs)
    from acb.runner.batch_invariant_dsa import indexer_ops

    ops = indexer_ops()  # the batch-invariant mode: the indexer's products and top-k in their fixed forms
    if ops is None:
        return _step_forward(original, sig, module, step, False, *args, **kwargs)
    with ops:
        return _step_forward(original, sig, module, step, True, *args, **kwargs)


def _step_forward(
    original: Any, sig: inspect.Signature, module: Any, step: _Step, fixed: bool, *args: Any, **kwargs: Any
) -> Any:
    rest = call_arguments(sig, module, args, kwargs)
    hidden = rest["hidden_states"]
    cos = rest["position_embeddings"][0]
    topk = getattr(module, "index_topk", None)
    shared: list[_Segment] = []
    if BATCH_SEGMENTS and isinstance(topk, int) and hidden.dim() == 3 and cos.dim() == 3 and cos.shape[0] == 1:
        # (per-token rotary tables [1, T, d], as the DSA models give their indexers)
        # (in the batch-invariant mode the top-k is a stable sort and the scores are exact per pair:
        # a padded row selects what the request's own row does, so every decode row shares the call)
        shared = [
            seg for seg in step.segments if seg.start + seg.hi - seg.lo <= topk or (fixed and seg.hi - seg.lo == 1)
        ]
    if len(shared) < 2:
        shared = []
    together = {id(seg) for seg in shared}
    outs: list[tuple[_Segment, torch.Tensor]] = [
        (seg, _segment_call(original, rest, step, seg)) for seg in step.segments if id(seg) not in together
    ]
    width = max((idx.shape[-1] for _, idx in outs), default=0)
    rows = _batch_call(original, rest, step, shared) if shared else None
    if rows is not None:
        width = max(width, rows.shape[-1])
    dtype = rows.dtype if rows is not None else outs[0][1].dtype
    out = torch.full((1, hidden.shape[1], width), -1, dtype=dtype, device=hidden.device)
    for seg, idx in outs:
        out[0, seg.lo : seg.hi, : idx.shape[-1]] = idx
    if rows is not None:
        tokens = torch.cat([torch.arange(seg.lo, seg.hi) for seg in shared]).to(hidden.device)
        out[0, tokens, : rows.shape[-1]] = rows
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
