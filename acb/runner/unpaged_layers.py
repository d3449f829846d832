"""Attention layers acb cannot page, run per request on the model's own cache: DeepSeek V4's
compressed attention (a sliding window of keys that are also the values, plus the entries a
compressor pools from every ``compress_rate`` tokens, of which a lightning indexer picks the
top-k per query in the ``compressed_sparse_attention`` layers).

Such a layer keeps, per sequence, more than K/V pages can hold: the compressor's buffer of
tokens that have not yet closed a window, the overlap slice of the last window, and the pooled
entries, which the model's own cache layer classes (``DynamicCache(config=...)`` builds them)
keep and update through their own methods (``store_compression_weights``,
``update_compressor_states``, ``update_overlap_state``). acb does not re-implement them: it keeps
one cache object of the model's own per request (by block-table row, as the state layers'
states), and within an engine step runs each such layer's own forward once per request segment
of the flattened batch, with that request's cache, the model's own mask for it (built once per
step, before the step's first layer writes the cache, as ``model.generate`` builds it once per
forward), and the model's own attention function (``acb.runner.attention.own_attention_here``).

Lifecycle (as :mod:`acb.runner.linear_state`): a request given a row starts with an empty cache
(new, or recomputed after a preemption); chunked prefill carries the cache from chunk to chunk;
``n > 1`` children fork a deep copy of the parent's after its prompt; prefix caching and offload
are off. These layers use no KV pages: the blocks only measure each request's length, and what
the caches hold grows with it (a sliding window, one pooled entry per ``compress_rate`` tokens).

The layers are found by what they do: attention modules whose class runs a compressor, a
submodule whose class calls the cache's ``update_compressor_states``.

In the batch-invariant mode the same per-request calls run with fixed forms inside the layers
(:mod:`acb.runner.batch_invariant_unpaged`: each query's keys gathered in order through acb's CPU
kernel, reached through the model module's ``eager_attention_forward``, which
``own_attention_here`` calls; the products, sums, softmax and top-k in orders the call's shape does
not set), so chunked prefill gives the bits a whole prompt gives.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from acb.runner.attention import own_attention_here
from acb.runner.intercept import Interception, call_arguments, code_names
from acb.runner.step import CURRENT, entered

# the cache-layer method a compressor's own code calls to keep its pooled entries
COMPRESSOR_INTERFACE = "update_compressor_states"


def find_unpaged_layers(model: torch.nn.Module) -> list[Any]:
    """The model's attention modules that run on its own cache: every module (with a
    ``layer_idx``) of a class some instance of which has a compressor submodule whose class
    calls ``update_compressor_states`` (a class's layers without a compressor, DeepSeek V4's
    sliding-only ones, share its K=V layout and go the same way). Empty for other models."""
    classes = {
        type(m)
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int)
        and any(COMPRESSOR_INTERFACE in code_names(type(c)) for c in m.children())
    }
    found = {m.layer_idx: m for m in model.modules() if type(m) in classes and isinstance(m.layer_idx, int)}
    return [found[i] for i in sorted(found)]


class UnpagedCaches:
    """The model's own cache object of each request row (made at its first step)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.rows: dict[int, Any] = {}

    def reset(self, row: int) -> None:
        self.rows.pop(row, None)

    def copy(self, src: int, dst: int) -> None:
        if src in self.rows:
            self.rows[dst] = copy.deepcopy(self.rows[src])
        else:
            self.rows.pop(dst, None)

    def clear(self) -> None:
        self.rows.clear()

    def of(self, row: int) -> Any:
        cache = self.rows.get(row)
        if cache is None:
            from transformers import DynamicCache

            cache = self.rows[row] = DynamicCache(config=self.config)
        return cache

    def nbytes(self) -> int:
        return sum(cache_nbytes(cache) for cache in self.rows.values())


def cache_nbytes(cache: Any, depth: int = 0) -> int:
    """The bytes of the tensors a cache object of the model's own holds (found in its
    attributes, lists, tuples and dicts, a few levels deep: a ``DynamicCache``'s layers, a
    Mamba cache's states, RWKV's list of state tensors)."""
    if isinstance(cache, torch.Tensor):
        return cache.nbytes
    if depth > 4 or cache is None or isinstance(cache, (int, float, str, bool)):
        return 0
    if isinstance(cache, dict):
        items: Any = cache.values()
    elif isinstance(cache, (list, tuple)):
        items = cache
    elif hasattr(cache, "__dict__"):
        items = vars(cache).values()
    else:
        return 0
    return sum(cache_nbytes(v, depth + 1) for v in items)


def unpaged_bytes_per_token(model: Any, max_len: int) -> int:
    """What one more token costs the model's own cache of a request, measured: two forwards of
    random tokens (``n`` and ``2n`` long, ``n`` up to 256, past any window a layer keeps only
    the end of at these sizes) into fresh caches, and the difference of their bytes per token.
    The engine sizes its blocks with it, so admission counts these caches against the budget."""
    n = max(8, min(256, max_len // 4))
    param = next(model.parameters())
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, 2 * n), generator=g).to(param.device)
    sizes = []
    with torch.no_grad():
        for length in (n, 2 * n):  # the cache the model builds for itself, whatever its kind
            out = model(input_ids=ids[:, :length], use_cache=True)
            cache = next(
                (out[name] for name in ("past_key_values", "cache_params", "state") if out.get(name) is not None), None
            )
            sizes.append(cache_nbytes(cache))
    return max(1, -(-(sizes[1] - sizes[0]) // n))


class _Step:
    __slots__ = ("caches", "segments", "masks")

    def __init__(self, caches: UnpagedCaches, segments: list[tuple[int, int, int]]) -> None:
        self.caches = caches
        self.segments = segments  # (first token, end, request row)
        self.masks: dict[int, Any] = {}  # row -> the request's mask for this step


@contextlib.contextmanager
def unpaged_step(caches: UnpagedCaches, num_new: list[int], rows: list[int]) -> Iterator[None]:
    """Within the block, the intercepted layers of this thread's forward run per request
    (``num_new`` tokens each, in batch order, on the caches of their ``rows``)."""
    segments, lo = [], 0
    for n, row in zip(num_new, rows):
        segments.append((lo, lo + n, row))
        lo += n
    with entered("unpaged", _Step(caches, segments)):
        yield


def _take(value: Any, lo: int, hi: int) -> Any:
    """A per-token argument for tokens ``lo:hi`` (tensors ``[1, T, ...]``; tuples and dicts of them)."""
    if isinstance(value, dict):
        return {k: _take(v, lo, hi) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_take(v, lo, hi) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        return value[:, lo:hi]
    return value


def _mask(config: Any, cache: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The model's own mask for one request's step, from its cache before the step."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    embeds = hidden.new_empty((1, position_ids.shape[1], 1))
    return create_sliding_window_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=cache,
        position_ids=position_ids,
    )


def _forward(original: Any, sig: inspect.Signature, module: Any, *args: Any, **kwargs: Any) -> Any:
    step: _Step | None = CURRENT.unpaged
    if step is None:  # not an engine step: the layer as it always was
        return original(*args, **kwargs)
    rest = call_arguments(sig, module, args, kwargs)
    hidden = rest.pop("hidden_states")
    position_ids = rest.pop("position_ids")
    rest.pop("acb_ctx", None)
    rest.pop("past_key_values", None)
    rest.pop("attention_mask", None)
    per_token = {k: v for k, v in rest.items() if k in ("position_embeddings",)}
    other = {k: v for k, v in rest.items() if k not in per_token}
    outs = []
    with own_attention_here():
        for lo, hi, row in step.segments:
            cache = step.caches.of(row)
            pos = position_ids[:, lo:hi]
            if row not in step.masks:  # the step's first such layer: the cache is as the step found it
                step.masks[row] = _mask(step.caches.config, cache, hidden, pos)  # (None: a mask function's "causal")
            mask = step.masks[row]
            if isinstance(mask, dict):
                mask = mask.get(getattr(module, "layer_type", None), next(iter(mask.values())))
            out = original(
                hidden_states=hidden[:, lo:hi],
                position_ids=pos,
                attention_mask=mask,
                past_key_values=cache,
                **{k: _take(v, lo, hi) for k, v in per_token.items()},
                **other,
            )
            outs.append(out[0] if isinstance(out, tuple) else out)
    joined = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return (joined, None)


class UnpagedLayers(Interception):
    """The interception of a model's own-cache attention layers (installed for an engine's life)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(find_unpaged_layers(model), _forward)
