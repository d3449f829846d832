"""The registry of layer kinds: each kind's :class:`acb.core.cache_spec.LayerKindSpec`, in one place.

A model's layers are found by the code they speak, each kind by its own module (paged attention:
transformers' attention interface, ``setup``; the MLA latent: ``latent``; an indexer's keys:
``indexed``; state layers: ``linear_state``; attention on the model's own cache objects:
``unpaged_layers``; the whole model on its own caches: ``own_cache_runner``; image embeddings: ``media``;
LoRA adapters' stacked buffers: ``lora``).
:data:`KINDS` lists, in order, one function per kind that describes what the runner found for it
(None: the model has no such layer), and :func:`layout_of` gathers them into the model's
:class:`~acb.core.cache_spec.CacheLayout` (``ModelRunner.layout``).

To add a layer kind: write its module (how its layers are found, what it intercepts, its per
request state), give the runner its object, and add its ``describe`` here; its spec's ``prefix``
and ``offload`` say what the engine may do with the model (the strictest kind wins), and its
bytes are what ``docs/memory.md`` reports. See "How to add a layer kind" in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from acb.core.cache_spec import CacheLayout, LayerKindSpec, Offload, PrefixRule
from acb.runner.indexed import indexed_step
from acb.runner.kv_cache import INDEX_KEYS, LATENT, UNPAGED
from acb.runner.linear_state import linear_step
from acb.runner.lora import LoraStep
from acb.runner.setup import hybrid_attention_layers
from acb.runner.step import entered
from acb.runner.unpaged_layers import unpaged_step

if TYPE_CHECKING:
    from acb.config import ResolvedConfig
    from acb.core.messages import SchedulerOutput
    from acb.runner.indexed import IndexedLayers
    from acb.runner.input_batch import PreparedBatch
    from acb.runner.kv_cache import KVCache
    from acb.runner.linear_state import LinearLayers, LinearStates
    from acb.runner.lora import LoraLayers
    from acb.runner.media import MediaEmbedder
    from acb.runner.own_cache_runner import OwnCacheRunner
    from acb.runner.unpaged_layers import UnpagedCaches, UnpagedLayers


class RunnerParts(Protocol):
    """What the kinds read of the model runner (:class:`acb.runner.model_runner.ModelRunner`):
    its config, its cache and each kind's layers and rows (None where the model has none)."""

    cfg: ResolvedConfig
    model: Any
    kv_cache: KVCache
    linear: LinearLayers | None  # state layers
    states: LinearStates  # their rows (rebuilt by sleep)
    state_row_bytes: int
    state_why: str
    indexed: IndexedLayers | None
    unpaged: UnpagedLayers | None
    unpaged_caches: UnpagedCaches | None
    own_cache_runner: OwnCacheRunner | None
    media: MediaEmbedder | None
    lora: LoraLayers | None  # LoRA adapters' stacked buffers (max_loras > 0)


def _model_layers_of(r: RunnerParts, cache_layers: set[int]) -> tuple[int, ...]:
    """The model's layer indices that read and write ``cache_layers`` (of a hybrid: its attention
    layers only; its state layers are mapped to a cache layer they never touch)."""
    spec = r.kv_cache.spec
    if spec.layer_map is None:
        return tuple(sorted(cache_layers))
    layers = [i for i, c in enumerate(spec.layer_map) if c in cache_layers]
    if r.linear is not None:
        attention = set(hybrid_attention_layers(r.model))
        layers = [i for i in layers if i in attention]
    return tuple(layers)


def _offload(r: RunnerParts) -> Offload:
    return Offload.PAGES if r.cfg.num_swap_blocks else Offload.NONE


def attention(r: RunnerParts) -> LayerKindSpec | None:
    """Paged K/V (full, sliding, per-layer shape groups)."""
    spec = r.kv_cache.spec
    groups = spec.kv_shapes()
    if r.own_cache_runner is not None or not groups:
        return None
    per_token = spec.bytes_per_token()
    cache_layers = {c for layers in groups.values() for c in layers}
    return LayerKindSpec(
        "attention",
        _model_layers_of(r, cache_layers),
        page_bytes_per_token=sum(v for k, v in per_token.items() if isinstance(k, tuple)),
        offload=_offload(r),
        why="" if r.cfg.num_swap_blocks else "no offload space (cpu_offload_space)",
    )


def latent(r: RunnerParts) -> LayerKindSpec | None:
    """MLA layers paged as their latent (``kv_lora_rank + qk_rope_head_dim`` per token)."""
    spec = r.kv_cache.spec
    if not spec.latent_layers:
        return None
    return LayerKindSpec(
        "latent",
        _model_layers_of(r, set(spec.latent_layers)),
        page_bytes_per_token=spec.bytes_per_token()[LATENT],
        offload=_offload(r),
    )


def index_keys(r: RunnerParts) -> LayerKindSpec | None:
    """Indexed sparse attention's key-only pages (DSA)."""
    spec = r.kv_cache.spec
    if not spec.index_layers:
        return None
    return LayerKindSpec(
        "index keys",
        spec.index_layers,
        page_bytes_per_token=spec.bytes_per_token()[INDEX_KEYS],
        offload=_offload(r),
    )


def state(r: RunnerParts) -> LayerKindSpec | None:
    """Linear attention, Mamba and short convolutions: a row of state per request."""
    if r.linear is None:
        return None
    cfg = r.cfg
    row = r.state_row_bytes
    why = []
    if not cfg.state_snapshots:
        why.append("no snapshots: " + r.state_why)
    if not cfg.state_host_rows:
        why.append("no host rows (cpu_offload_space)" if r.unpaged is None else "the model also keeps its own caches")
    return LayerKindSpec(
        "state",
        tuple(sorted(int(m.layer_idx) for m in r.linear.layers)),
        row_bytes=row,
        snapshot_bytes=row,
        prefix=PrefixRule.SNAPSHOT if cfg.state_snapshots else PrefixRule.NONE,
        offload=Offload.ROW if cfg.state_host_rows else Offload.NONE,
        why="; ".join(why),
    )


def unpaged(r: RunnerParts) -> LayerKindSpec | None:
    """Attention layers on the model's own cache objects, inside the paged path (DeepSeek V4)."""
    if r.unpaged is None:
        return None
    return LayerKindSpec(
        "unpaged",
        tuple(sorted(int(m.layer_idx) for m in r.unpaged.layers)),
        token_bytes=r.kv_cache.spec.bytes_per_token().get(UNPAGED, 0),
        prefix=PrefixRule.NONE,
        offload=Offload.NONE,
        why="compressed caches are not cut at block boundaries or offloaded yet (recomputed)",
    )


def own_cache_runner(r: RunnerParts) -> LayerKindSpec | None:
    """The whole model on its own cache objects (the second runner path)."""
    if r.own_cache_runner is None:
        return None
    on = r.cfg.prefix_caching
    return LayerKindSpec(
        "own cache runner",
        (),
        token_bytes=r.kv_cache.spec.bytes_per_token().get(UNPAGED, 0),
        prefix=PrefixRule.SNAPSHOT if on else PrefixRule.NONE,
        offload=Offload.NONE,
        why=("" if on else "its cache cannot be cut at a block boundary exactly (or prefix caching is off); ")
        + "a preempted request recomputes",
    )


def images(r: RunnerParts) -> LayerKindSpec | None:
    """Image embeddings, kept per request and reused while cached (keyed in the block digests)."""
    if r.media is None:
        return None
    return LayerKindSpec("media", (), reserved_bytes=r.cfg.image_cache_bytes)


def lora(r: RunnerParts) -> LayerKindSpec | None:
    """LoRA adapters: stacked buffers for every target linear, set aside once (``max_loras + 1``
    slots of ``max_lora_rank``); a request's adapter salts its prefix keys (no sharing across)."""
    if r.lora is None:
        return None
    return LayerKindSpec("lora", (), reserved_bytes=r.lora.reserved_bytes)


# the kinds, in the order a layer is offered to them
KINDS: tuple[Callable[[RunnerParts], LayerKindSpec | None], ...] = (
    latent,
    index_keys,
    attention,
    state,
    unpaged,
    own_cache_runner,
    images,
    lora,
)


def layout_of(runner: RunnerParts) -> CacheLayout:
    """The model's cache layout, as the runner set it up."""
    return CacheLayout(tuple(k for k in (describe(runner) for describe in KINDS) if k is not None))


# ---------------------------------------------------------------------------------------------
# What each kind does around a step's forward, in one place: RunnerParts._execute calls every
# hook's begin_step (rows given, freed, restored, offloaded), enters every step() context around
# the paged forward (the kind's layers run per request segment inside it), then end_step (forks).


class StepHooks:
    """A kind's part of a step (by default: none)."""

    def begin_step(self, sched: SchedulerOutput) -> None:
        """Before the forward: a row given to a request starts empty (or restored, or swapped in)."""

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None] | None:
        """The context the paged forward runs in, for this kind's layers (None: none needed)."""
        return None

    def end_step(self, sched: SchedulerOutput) -> None:
        """After the forward: forks copy the parent's per-request state."""


class StateHooks(StepHooks):
    """State layers: the rows of ``runner.states`` (rebuilt by sleep, so read through the runner)."""

    def __init__(self, runner: RunnerParts) -> None:
        self.runner = runner

    def begin_step(self, sched: SchedulerOutput) -> None:
        states = self.runner.states
        for row, host_row in sched.row_swap_out:  # first: a preempted request's row may be reused here
            states.swap_out(row, host_row)
        for req in sched.row_inits:  # a request given a row starts with no state (new, or recomputed)
            states.reset(req.row)
        for slot, row in sched.restores:  # or, on a prefix hit, with the state where the hit ends
            states.restore(slot, row)
        for host_row, row in sched.row_swap_in:  # or, resumed from host memory, with its own state
            states.swap_in(host_row, row)

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None]:
        return linear_step(self.runner.states, sched.num_new, sched.rows, sched.snapshots)

    def end_step(self, sched: SchedulerOutput) -> None:
        for src, dst in sched.state_copies_after:
            self.runner.states.copy(src, dst)


class IndexHooks(StepHooks):
    """Indexers (DSA): their keys read and written in the request's pages."""

    def __init__(self, runner: RunnerParts) -> None:
        self.runner = runner

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None]:
        return indexed_step(self.runner.kv_cache, batch.attn)


class UnpagedHooks(StepHooks):
    """Attention layers on the model's own cache objects (DeepSeek V4), one per request row."""

    def __init__(self, caches: UnpagedCaches) -> None:
        self.caches = caches

    def begin_step(self, sched: SchedulerOutput) -> None:
        for row in sched.freed_rows:  # a freed row's cache goes; a row given starts empty
            self.caches.reset(row)
        for req in sched.row_inits:
            self.caches.reset(req.row)

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None]:
        return unpaged_step(self.caches, sched.num_new, sched.rows)

    def end_step(self, sched: SchedulerOutput) -> None:
        for src, dst in sched.state_copies_after:
            self.caches.copy(src, dst)


class OwnCacheRunnerHooks(StepHooks):
    """The whole model on its own caches: its forward replaces the paged one (``_execute``)."""

    def __init__(self, own: OwnCacheRunner) -> None:
        self.runner = own

    def begin_step(self, sched: SchedulerOutput) -> None:
        own = self.runner
        for row in sched.freed_rows:
            own.reset(row)
        for req in sched.row_inits:
            # a recompute, on a model whose cache takes no chunks: replayed from its prompt
            own.reset(req.row, req.prompt_len if len(req.token_ids) > req.prompt_len else None)
        for slot, row in sched.restores:  # a prefix hit: a copy of the cache cut where the hit ends
            own.restore(slot, row)

    def end_step(self, sched: SchedulerOutput) -> None:
        if sched.snapshots:  # the caches cut at block boundaries, kept with the cached blocks
            self.runner.snapshot(sched.snapshots, sched.num_new, sched.rows)
        for src, dst in sched.state_copies_after:  # forks: children start from the parent's cache
            self.runner.copy(src, dst)


class MediaHooks(StepHooks):
    """Image embeddings: kept per request, reusable once its row is freed, until evicted."""

    def __init__(self, media: MediaEmbedder) -> None:
        self.media = media

    def begin_step(self, sched: SchedulerOutput) -> None:
        for row in sched.freed_rows:
            self.media.release(row)

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None] | None:
        # the language model takes the step's image rows (MediaEmbedder.step_inputs built them)
        return self.media.language_model_kwargs() if batch.inputs_embeds is not None else None


class LoraHooks(StepHooks):
    """LoRA adapters: the step's adapter rows (staged with its inputs) reach the target linears'
    interception as ``CURRENT.lora``; a step with none enters nothing."""

    def __init__(self, layers: LoraLayers) -> None:
        self.layers = layers

    def step(self, sched: SchedulerOutput, batch: PreparedBatch) -> contextlib.AbstractContextManager[None] | None:
        return None if batch.lora is None else entered("lora", LoraStep(self.layers, batch.lora))


def hooks_of(runner: RunnerParts) -> list[StepHooks]:
    """The step hooks of the kinds the runner has, in the order they act."""
    hooks: list[StepHooks] = []
    if runner.linear is not None:
        hooks.append(StateHooks(runner))
    if runner.indexed is not None:
        hooks.append(IndexHooks(runner))
    if runner.unpaged_caches is not None:
        hooks.append(UnpagedHooks(runner.unpaged_caches))
    if runner.own_cache_runner is not None:
        hooks.append(OwnCacheRunnerHooks(runner.own_cache_runner))
    if runner.media is not None:
        hooks.append(MediaHooks(runner.media))
    if runner.lora is not None:
        hooks.append(LoraHooks(runner.lora))
    return hooks
