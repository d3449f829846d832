"""The second runner path: models acb cannot page, run on the model's own cache objects.

A model whose attention does not go through transformers' attention interface (BLOOM, GPT-J,
GPT-Neo, Falcon, MPT, CodeGen, ...), or that does something acb's paged attention cannot follow
(DiffLlama's two calls per layer, Doge's content-dependent mask, ...), still runs under
``model.generate``: with a cache object of its own (``DynamicCache``) and a padded batch. This
path runs it the same way inside acb's engine, so the scheduler, sampling, the API, the server,
scoring and the integrations are the same; only the forward of a step differs.

Each running request (by block-table row) keeps the cache the model builds for it. A step:

* **decode rows** (one new token, a cache of their own) run as one padded batch, as
  ``model.generate``'s padded decoding does: their caches are kept stacked in one batch cache,
  left-padded to the longest, with a 2-D attention mask that hides the padding and each row's
  real positions. The batch's layers keep their rows in buffers with spare rows and columns
  (:class:`_DecodeBatch`): a step appends its column in place, a request joins by copying its own
  cache into a free row (the batch widened on the left if it is longer), a request that leaves
  (finished, cancelled, preempted, or scheduled for more than one token) is replaced by the last
  row, and padding columns no row needs any more are dropped by moving the view's start. No
  step copies the other rows' caches;
* **prefill segments** (new requests' whole prompts, a prompt's chunks), when a step has two or
  more whose only wanted logits are their last token's (or none: a chunk), run as left-padded
  batches of like lengths (sorted, a new group where a row would be padded by more than a quarter
  of the group's width), as ``model.generate``'s padded prefill: a chunk that goes on from the
  request's own cache has that cache stacked, right-aligned, before its tokens (so it heads its
  group: the group's other rows are no wider, and no padding sits between its cache and its
  tokens; where the start-up try finds that exact). The group's caches join the decode batch (a row still prefilling leaves it again at
  its next step, as its own cache; ``BATCH_PREFILL = False``: only new whole prompts are
  grouped);
* **every other segment** runs one request at a time on its own cache (a lone prefill, scoring
  continuations, a fork's own tokens, a model that cannot be batched), through the model's
  own generation hooks, as ``model.generate`` runs one unpadded prompt: its
  ``prepare_inputs_for_generation`` builds the forward's arguments from the request's tokens so
  far and its generation state (the cache, whatever its argument's name: ``past_key_values``,
  Mamba's ``cache_params``, RWKV's ``state``; position ids), and its
  ``_update_model_kwargs_for_generation`` carries that state to the next call.

Batching decode rows needs a model that takes position ids and prepares its inputs as
transformers' default does, and caches whose layers are all plain ``DynamicLayer`` (keys and
values ``[batch, heads, length, dim]``, grown by concatenation): a model whose cache has other layers
(sliding windows that crop, recurrent states) runs every segment on its own instead, and
prefills each prompt in one step (``model.generate`` never resumes such a cache mid-prompt, and
Moshi's sliding-window cache gives other tokens when it does).

A model that keeps a request's state in its modules' attributes instead of its cache object
(RecurrentGemma's recurrent blocks: :mod:`acb.runner.module_state`) is found by the first start-up
try, runs one request at a time, and each request's values of those attributes are put back
before its forward and taken after it, as if it ran alone; a try that interleaves two requests
proves it, or the model is refused.

Lifecycle: a request given a row starts with no cache (new, or recomputed after a preemption);
children of ``n > 1`` fork a deep copy of the parent's; a freed row's cache goes at once. No
pages, no offload, no decode graphs.

Prefix caching (:mod:`acb.core.kv_manager`'s snapshots, as for state layers): where a prompt
crosses a block boundary the scheduler planned, the request's cache after the step's forward is
copied and cut back to that position (``snapshot``: every layer's keys and values up to it, the
prompt's ids up to it) into a slot kept with the cached block; a prefix hit gives the request's
row a copy of the slot's cache and ids (``restore``) and its prefill goes on from there, as a
chunked prefill does. A cut is exact only for caches of plain growing K/V layers behind
transformers' default generation hooks: a start-up try (a prompt cut at a position and resumed
must give what it gives whole) decides it (``croppable``). The others keep prefix caching off:
a sliding-window layer (Moshi, DeepSeek V4's) has dropped the keys before the window and cannot
be cut back; a recurrent or convolutional state (Mamba's ``cache_params``, RWKV's ``state``,
RecurrentGemma's module attributes) holds no per-position history to cut; a model with its own
generation hooks (XLNet, Reformer, ProphetNet) may not resume a prompt at all (it prefills whole).
A slot costs up to ``max_model_len`` tokens of the model's own cache and is priced so
(:func:`snapshot_memory`).

The batch-invariant mode (``batch_invariant=True``: :mod:`acb.runner.batch_invariant_own`)
prefills each prompt whole, in one step (no chunks, so no prefix caching; a recompute replays the
prompt, then a token a call), each step under the mode's ops and the language model's attention
set to the mode's. Its rows run in the batched forms above (left-padded prefill groups of whole
prompts, stacked decode rows) where a start-up try proves them bit for bit equal to each row run
alone (:func:`acb.runner.batch_invariant_own.batched_rows_differ`: ``mode_rows == "batched"``),
else one row a call, as ``model.generate`` runs one unpadded prompt (``mode_rows == "alone"``,
the reason in ``mode_rows_why``, logged).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import inspect
import itertools
import logging
from typing import Any

import torch

from acb.config import ContinuousBatchingConfig, ResolvedConfig
from acb.errors import UnsupportedModelError
from acb.runner.module_state import ModuleState, Slot, Values, describe

logger = logging.getLogger(__name__)

# prefill chunks (a prompt's first, and those that go on from a request's own cache) join the
# step's left-padded prefill groups; False: only new requests' whole prompts do (the A/B switch of
# benchmarks/own_cache_offline.py)
BATCH_PREFILL = True
# True: the batch-invariant mode runs each request's forwards alone (a prompt whole, a token a
# call) whatever the start-up try finds (the A/B switch of benchmarks/batch_invariant_own.py,
# which measures what one row a call costs); False: the batched forms where the try proves them
MODE_ALONE = False


def _dynamic_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def _plain(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain growing K/V layer (batchable by stacking)."""
    layers: Any = getattr(cache, "layers", None)
    cls = _dynamic_layer_class()
    return bool(layers) and all(type(layer) is cls and getattr(layer, "is_initialized", False) for layer in layers)


def _batch_layer_class() -> type:
    """``DynamicLayer`` of the decode batch: its rows' keys and values in buffers with room on
    both sides of the filled columns ``[s, e)`` and spare rows. A step appends its column in
    place (not a copy of every cached one, as ``torch.cat`` does), a request joins or leaves by
    copying its own row alone, and padding columns no row needs any more are dropped by moving
    ``s``. ``keys`` and ``values`` are views of the rows in use; unused columns hold zeros (the
    padding ``model.generate``'s padded batch has) or a former row's finite values, masked."""
    global _BATCH_LAYER
    if _BATCH_LAYER is not None:
        return _BATCH_LAYER
    base = _dynamic_layer_class()

    class BatchLayer(base):  # type: ignore[misc, valid-type]
        def start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            self.lazy_initialization(keys, values)
            self._k = keys.new_zeros((0, keys.shape[1], 0, keys.shape[3]))
            self._v = values.new_zeros((0, values.shape[1], 0, values.shape[3]))
            self._r = self._s = self._e = 0
            self._view()

        def _view(self) -> None:
            self.keys = self._k[: self._r, :, self._s : self._e]
            self.values = self._v[: self._r, :, self._s : self._e]

        def _realloc(self, rows: int, left: int, right: int) -> None:
            """New buffers of ``rows`` rows, ``left`` free columns, the filled ones, ``right`` free."""
            width = self._e - self._s
            buffers = []
            for old in (self._k, self._v):
                new = old.new_zeros((rows, old.shape[1], left + width + right, old.shape[3]))
                new[: self._r, :, left : left + width] = old[: self._r, :, self._s : self._e]
                buffers.append(new)
            self._k, self._v = buffers
            self._s, self._e = left, left + width
            self._view()

        def put(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Rows ``slot...`` get these rows' K/V, right-aligned (no wider than the batch)."""
            n, w = keys.shape[0], keys.shape[2]
            if slot + n > self._k.shape[0]:
                self._realloc(max(slot + n, self._k.shape[0] * 3 // 2, 4), self._s, self._k.shape[2] - self._e)
            for buf, src in ((self._k, keys), (self._v, values)):
                buf[slot : slot + n, :, self._s : self._e - w].zero_()
                buf[slot : slot + n, :, self._e - w : self._e] = src
            self._r = max(self._r, slot + n)
            self._view()

        def widen(self, n: int) -> None:
            """``n`` more columns on the left (zeros: padding)."""
            if self._s < n:
                self._realloc(self._k.shape[0], n + max(16, (self._e - self._s) // 4), self._k.shape[2] - self._e)
            self._s -= n
            self._k[: self._r, :, self._s : self._s + n].zero_()
            self._v[: self._r, :, self._s : self._s + n].zero_()
            self._view()

        def move(self, src: int, dst: int) -> None:
            self._k[dst, :, self._s : self._e] = self._k[src, :, self._s : self._e]
            self._v[dst, :, self._s : self._e] = self._v[src, :, self._s : self._e]

        def shape_to(self, rows: int, trim: int) -> None:
            """The first ``rows`` rows in use, ``trim`` columns dropped on the left."""
            self._r, self._s = rows, self._s + trim
            self._view()

        def row(self, i: int, pad: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            """Row ``i``'s K/V without its padding (its first ``length`` positions; copies)."""
            lo = self._s + pad
            hi = self._e if length is None else lo + length
            return self._k[i : i + 1, :, lo:hi].clone(), self._v[i : i + 1, :, lo:hi].clone()

        def nbytes(self) -> int:
            return int(self._k.nbytes + self._v.nbytes)

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            add = key_states.shape[2]
            if self._e + add > self._k.shape[2]:  # out of room on the right: a quarter more, once in a while
                self._realloc(self._k.shape[0], self._s, add + max(16, (self._e - self._s) // 4))
            self._k[: self._r, :, self._e : self._e + add] = key_states
            self._v[: self._r, :, self._e : self._e + add] = value_states
            self._e += add
            self._view()
            return self.keys, self.values

    _BATCH_LAYER = BatchLayer
    return BatchLayer


_BATCH_LAYER: type | None = None


class _DecodeBatch:
    """The decode rows' caches as one left-padded batch cache of the model's own class (its
    layers :func:`_batch_layer_class`): ``rows[i]`` is batch row ``i``'s acb row, ``pads[i]`` its
    left padding. Rows stay dense: a row that leaves is filled by the last one."""

    def __init__(self, like: Any) -> None:
        self.cache = copy.copy(like)
        self.cache.layers = [_batch_layer_class()() for _ in like.layers]
        for layer, src in zip(self.cache.layers, like.layers):
            layer.start(src.keys, src.values)
        self.rows: list[int] = []
        self.pads: list[int] = []

    @property
    def width(self) -> int:
        return int(self.cache.layers[0].keys.shape[2])

    def add(self, cache: Any, pads: list[int], rows: list[int]) -> None:
        """Rows of another batch cache (plain layers, each row left-padded by ``pads``) join."""
        w, width = int(cache.layers[0].keys.shape[2]), self.width
        if w > width:  # (everyone's padding grows)
            for layer in self.cache.layers:
                layer.widen(w - width)
            self.pads = [p + w - width for p in self.pads]
            width = w
        for layer, src in zip(self.cache.layers, cache.layers):
            layer.put(len(self.rows), src.keys, src.values)
        self.rows += rows
        self.pads += [p + width - w for p in pads]

    def remove(self, rows: list[int]) -> None:
        """These rows leave (the last rows move into their places; padding no row needs goes)."""
        for row in rows:
            i, last = self.rows.index(row), len(self.rows) - 1
            if i != last:
                for layer in self.cache.layers:
                    layer.move(last, i)
                self.rows[i], self.pads[i] = self.rows[last], self.pads[last]
            self.rows.pop()
            self.pads.pop()
        trim = min(self.pads, default=0)
        self.pads = [p - trim for p in self.pads]
        for layer in self.cache.layers:
            layer.shape_to(len(self.rows), trim)

    def take(self, row: int, like: Any) -> Any:
        """``row``'s cache alone, without padding (a new cache of plain layers, shaped ``like``)."""
        out = self.copy_of(row, like)
        self.remove([row])
        return out

    def copy_of(self, row: int, like: Any, length: int | None = None) -> Any:
        """A copy of ``row``'s cache (its first ``length`` positions), without padding; the row stays."""
        i = self.rows.index(row)
        return _plain_cache(like, [layer.row(i, self.pads[i], length) for layer in self.cache.layers])

    def mask(self, device: torch.device) -> torch.Tensor:
        """The attention mask of a decode step: ``[rows, width + 1]``, zeros over each row's padding."""
        pads = torch.tensor(self.pads, dtype=torch.long, device=device)
        return (torch.arange(self.width + 1, device=device)[None] >= pads[:, None]).long()

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.cache.layers)


def _plain_cache(like: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A cache of ``like``'s class whose plain layers hold these keys and values (not copied)."""
    out = copy.copy(like)
    out.layers = [_dynamic_layer_class()() for _ in kv]
    for layer, (keys, values) in zip(out.layers, kv):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return out


def _cut(cache: Any, length: int) -> Any:
    """A copy of a plain cache's first ``length`` positions (every layer's keys and values)."""
    return _plain_cache(
        cache, [(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone()) for layer in cache.layers]
    )


def snapshot_memory(
    cfg: ResolvedConfig, config: ContinuousBatchingConfig, bytes_per_token: int, budget: int
) -> tuple[ResolvedConfig, int]:
    """Price the snapshots of prefix caching on the model's own caches; returns the config (with
    the snapshots' token budget, and fewer blocks when the cache is sized from the budget) and the
    number of slots.

    A slot holds one request's cache cut at a block boundary of its prompt, as many tokens as the
    boundary's position at ``bytes_per_token`` (the own cache's measured cost). The snapshots are
    bounded by the tokens they hold together (``snapshot_tokens``: the core evicts the least
    recently used ones to fit a new one): a quarter of ``budget`` (the KV cache's memory budget, as
    the state layers' snapshots get), or with ``state_snapshots`` set, that many slots of
    ``max_model_len`` tokens. The slots are four per request row (or ``state_snapshots``). Where
    the blocks are sized from the budget (``num_blocks`` unset) they give up the snapshots' bytes,
    keeping room for one request of ``max_model_len``."""
    per_token = max(1, bytes_per_token)
    if config.state_snapshots is not None:
        slots = config.state_snapshots
        tokens = slots * cfg.max_model_len
    else:
        slots = 4 * (cfg.max_requests_per_batch + 1)
        tokens = budget // 4 // per_token
    per_block = cfg.block_size * bytes_per_token
    if config.num_blocks is None and per_block and slots:
        needed = cfg.max_blocks_per_seq + 1
        room = max(0, cfg.num_blocks - needed) * cfg.block_size
        if config.state_snapshots is None:
            tokens = min(tokens, room)
        num_blocks = max(needed, cfg.num_blocks - -(-tokens // cfg.block_size))
        cfg = dataclasses.replace(
            cfg,
            num_blocks=num_blocks,
            kv_cache_bytes=num_blocks * per_block,
            max_model_len=min(cfg.max_model_len, (num_blocks - 1) * cfg.block_size),
        )
    if tokens < cfg.block_size:  # not one block's snapshot fits
        slots = 0
    return dataclasses.replace(cfg, snapshot_tokens=tokens if slots else 0), slots


def _length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _cache_of(kw: dict[str, Any]) -> Any:
    """The cache in a request's generation state (whatever the model names it)."""
    for name in ("past_key_values", "cache_params", "state"):
        if kw.get(name) is not None:
            return kw[name]
    return None


class OwnCacheRunner:
    """Runs engine steps on the model's own caches (see the module docstring)."""

    def __init__(self, model: Any, start: dict[Slot, Any] | None = None, batch_invariant: bool = False) -> None:
        """``start``: the model's module attributes before the engine ran any forward of it
        (:func:`acb.runner.module_state.module_attributes`): what a new request starts from.
        ``batch_invariant``: the mode (:mod:`acb.runner.batch_invariant_own`): each prompt whole,
        under the mode's ops and attention, the rows batched where the start-up try proves that
        exact (``mode_rows``), else each request's forwards alone (a prompt, then a token a call)."""
        self.model = model
        self.batch_invariant = batch_invariant
        self._start = start
        self.config = model.config
        params = inspect.signature(type(model).forward).parameters
        self._positions = "position_ids" in params
        self._keep = "logits_to_keep" in params and bool(getattr(model, "_supports_logits_to_keep", lambda: False)())
        from transformers.generation.utils import GenerationMixin

        # a model whose generation hooks are transformers' defaults (not XLNet's dummy token,
        # Mamba's cache_params, a decoder's positions counted from its cache length...)
        default_hooks = all(
            getattr(type(model), name, None) is getattr(GenerationMixin, name)
            for name in ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")
        )
        # position ids in a request's generation state, unless the start-up try finds the model's
        # own hooks break on them (Reformer's forward, handed them with a cache, fails)
        self._pass_positions = self._positions and not getattr(self.config, "is_encoder_decoder", False)
        self._batch_ok = default_hooks and self._positions and not getattr(self.config, "is_encoder_decoder", False)
        # row -> a request's generation state (the model's kwargs between calls: its cache, ...)
        # while it is not in the batch, and its tokens so far
        self.single: dict[int, dict[str, Any]] = {}
        self.ids: dict[int, torch.Tensor] = {}
        # row -> its prompt's length, for a request recomputed (after a preemption, or sleep) on
        # a model whose cache cannot take a prompt in chunks: replayed as model.generate made it
        self.replays: dict[int, int] = {}
        self.batch: _DecodeBatch | None = None  # the decode rows, or None
        # state the model keeps in module attributes (found by the first start-up try), and each
        # row's values of it between its calls
        self.module_state: ModuleState | None = None
        self.held: dict[int, Values] = {}
        # the cache layers the model's config asks for: anything but plain growing K/V layers
        # (sliding windows that crop, states) is neither stacked into a batch nor resumed from in a
        # later prefill chunk (model.generate never chunks a prompt; those layers may not follow)
        from transformers import DynamicCache

        kinds = {type(layer) for layer in getattr(DynamicCache(config=self.config), "layers", ())}
        self.plain = kinds <= {_dynamic_layer_class()}
        self.batchable = self.plain and self._batch_ok  # False once a cache shows layers that cannot be stacked
        # a prompt may be prefilled in chunks (model.generate never does that): plain caches behind
        # the default generation hooks only (XLNet re-reads its whole input with a dummy token)
        self.chunkable = self.plain and default_hooks
        # a later chunk's cache stacked with others' in a prefill group (:meth:`_groups`): found
        # by the start-up try
        self.group_chunks = False
        # prefix caching: slot -> a request's generation state and ids cut at a block boundary
        # (see the module docstring); whether a cut is exact is found by the start-up try
        self.snaps: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
        self.croppable = False
        # the mode: "batched" (its rows in the batched forms, proved exact at start) or "alone"
        # (one row a call), and why (None outside the mode)
        self.mode_rows: str | None = None
        self.mode_rows_why = ""
        if batch_invariant:  # each prompt whole, in one call (as model.generate and a trainer's forward take it)
            self.chunkable = False
            if MODE_ALONE:
                self.batchable = False
        self._probe()
        if batch_invariant:
            self._mode_rows(default_hooks)
        if not self.croppable:
            logger.info(
                "%s's own cache cannot be cut at a block boundary (%s): no prefix caching",
                type(model).__name__,
                self._uncut(default_hooks),
            )

    def _uncut(self, default_hooks: bool) -> str:
        """Why a request's cache cannot be cut exactly (see the module docstring)."""
        if self.batch_invariant:
            return "batch_invariant=True prefills each prompt whole, in one call"
        if not self.plain:
            kinds = sorted({type(layer).__name__ for layer in getattr(self._empty(), "layers", ())})
            return f"layers other than plain growing K/V: {', '.join(kinds) or 'a cache of its own'}"
        if not default_hooks:
            return "its own generation hooks, which may not resume a prompt"
        if self.module_state is not None:
            return "state kept in module attributes"
        if not self.chunkable:
            return "a prompt in two chunks does not give what it gives whole"
        return "a prompt cut and resumed does not give what it gives whole"

    def _mode_rows(self, default_hooks: bool) -> None:
        """The mode's form (``mode_rows``): the batched forms where the path batches this model
        and :func:`acb.runner.batch_invariant_own.batched_rows_differ` finds each row of them bit
        for bit what it gives alone; else one row a call (logged, with why)."""
        from acb.runner.batch_invariant_own import batched_rows_differ

        name = type(self.model).__name__
        if self.batchable:
            problem = batched_rows_differ(self)
            if problem is None:
                self.mode_rows = "batched"
                logger.info(
                    "batch_invariant=True: %s's rows run batched (left-padded prefill groups, stacked decode rows): "
                    "the start-up try found each row's logits bit for bit what it gives alone",
                    name,
                )
                return
            self.batchable = False
            why = problem
        elif MODE_ALONE:
            why = "own_cache_runner.MODE_ALONE is set"
        elif self.module_state is not None:
            why = "it keeps per-request state in module attributes"
        elif not self.plain:
            kinds = sorted({type(layer).__name__ for layer in getattr(self._empty(), "layers", ())})
            why = f"its cache has layers other than plain growing K/V ({', '.join(kinds) or 'a cache of its own'})"
        elif not default_hooks:
            why = "it has generation hooks of its own (a padded batch of its rows would not follow them)"
        elif not self._positions:
            why = "its forward takes no position ids (a left-padded row's positions would count its padding)"
        elif not self._batch_ok:
            why = "an encoder-decoder's rows are not batched on this path"
        else:
            why = (
                "the path's start-up try of two requests as one padded batch failed, or gave other than what they "
                "give one at a time (beyond rounding)"
            )
        self.mode_rows, self.mode_rows_why = "alone", why
        logger.info("batch_invariant=True: %s's requests run one row a call: %s", name, why)

    # start-up tries ------------------------------------------------------------
    def _probe(self) -> None:
        """Try what the model's own code is assumed to do, on scratch rows, once at start: a
        prompt prefilled in two chunks must give what it gives whole (ProphetNet's cache takes
        one token at a time after the first call), and two requests decoded as one padded batch
        what they give one at a time (GIT's mask does not follow left padding), and two chunks
        going on from their caches (stacked, left-padded) as one padded batch what they give one
        at a time. What fails the try is not done: prompts are prefilled whole, decode rows run one
        at a time, chunks one at a time."""
        param = next(self.model.parameters())
        vocab = int(self.config.get_text_config().vocab_size)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, vocab, (1, 14), generator=g).to(param.device)

        def run(steps: list[tuple[list[int], list[int], list[torch.Tensor]]]) -> torch.Tensor:
            out = None
            for rows, lens, parts in steps:
                ids = torch.cat(parts, dim=1)
                starts = [int(self.ids[r].shape[1]) if r in self.ids else 0 for r in rows]
                pos = torch.cat([torch.arange(a, a + n, device=ids.device) for a, n in zip(starts, lens)])[None]
                ends = list(itertools.accumulate(lens))
                out = self.forward(ids, pos, lens, rows, [e - 1 for e in ends])
            assert out is not None
            return out.float()

        def close(a: torch.Tensor, b: torch.Tensor) -> bool:
            return bool(torch.allclose(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()) + 1e-6))

        def first() -> None:
            for pass_positions in (True, False):  # a prompt, then a token: with position ids, else without
                if not pass_positions:
                    self._pass_positions = False
                try:
                    run([([-7], [12], [tokens[:, :12]]), ([-7], [1], [tokens[:, 12:13]])])
                    break
                except Exception:  # noqa: BLE001 - tried again without them, then left to the requests
                    self.reset(-7)

        with torch.no_grad():
            # the first try also shows state the model keeps outside its cache (module attributes)
            self.module_state = ModuleState.of(self.model, first, self._start)
            if self.module_state is not None:
                self._interleaved_try(run, tokens, close)
            if self.chunkable:
                try:
                    whole = run([([-1], [12], [tokens[:, :12]])])
                    chunked = run([([-2], [7], [tokens[:, :7]]), ([-2], [5], [tokens[:, 7:12]])])
                    self.chunkable = close(chunked, whole)
                except Exception:  # noqa: BLE001 - a cache that cannot take a chunk: prefill whole
                    self.chunkable = False
            if self.chunkable and self.module_state is None:
                try:  # (a prompt cut at a position, restored into another row and resumed)
                    if not _plain(_cache_of(self.single[-1])):  # (a cache of other layers than its config's)
                        raise ValueError("not plain")
                    self.snapshot([(-1, 7, -1)], [12], [-1])
                    self.restore(-1, -11)
                    self.croppable = close(run([([-11], [5], [tokens[:, 7:12]])]), whole)
                except Exception:  # noqa: BLE001 - a cache that cannot be cut: no prefix caching
                    self.croppable = False
                self.snaps.pop(-1, None)
            if self.batchable:
                # the prompts prefilled as one padded batch, then decoded as one; then (a cache that
                # takes chunks) a chunk each, their caches of 6 and 10 tokens stacked
                steps = [([5, 9], [tokens[:, :5], tokens[:, 5:14]]), ([1, 1], [tokens[:, 5:6], tokens[:, 1:2]])]
                chunks = ([3, 3], [tokens[:, 6:9], tokens[:, 2:5]])
                try:
                    batched = [run([([-3, -4], lens, parts)]) for lens, parts in steps]
                    self.batchable = False
                    single = [run([([-5, -6], lens, parts)]) for lens, parts in steps]
                    self.batchable = all(close(x, y) for x, y in zip(batched, single))
                except Exception:  # noqa: BLE001 - a cache that cannot be stacked: one row at a time
                    self.batchable = False
                if self.batchable and self.chunkable:
                    try:
                        alone = run([([-6, -5], *chunks)])  # (single caches, batchable on: a group)
                        self.group_chunks = True
                        grouped = run([([-4, -3], *chunks)])
                        self.group_chunks = close(grouped, alone)
                    except Exception:  # noqa: BLE001 - chunks one at a time
                        self.group_chunks = False
        for row in range(-11, 0):
            self.reset(row)

    def _interleaved_try(self, run: Any, tokens: torch.Tensor, close: Any) -> None:
        """A model with state in its module attributes: runs one request at a time (its decode
        rows are not stacked), with each request's values put back around its forward. Two
        requests interleaved must give what one alone gives, or the model is refused."""
        assert self.module_state is not None
        self.batchable = False
        self.reset(-7)
        names = describe(self.module_state.slots, self.model)
        try:
            alone = [run([([-8], [9], [tokens[:, :9]])]), run([([-8], [1], [tokens[:, 9:10]])])]
            mixed = [run([([-9], [9], [tokens[:, :9]])])]
            run([([-10], [6], [tokens[:, 3:9]])])
            mixed.append(run([([-9], [1], [tokens[:, 9:10]])]))
        except Exception as exc:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} keeps per-request state in module attributes ({names}) and failed "
                f"when two requests were interleaved with their own values ({type(exc).__name__}: {exc})"
            ) from exc
        if not all(close(x, y) for x, y in zip(mixed, alone)):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} keeps per-request state in module attributes ({names}) that acb "
                "cannot give each request on its own: two requests interleaved differ from one alone"
            )
        logger.info(
            "%s keeps per-request state in module attributes (%s): its requests run one at a time, each on its own",
            type(self.model).__name__,
            names,
        )

    # lifecycle ---------------------------------------------------------------
    def reset(self, row: int, prompt_len: int | None = None) -> None:
        """The row's request starts with no cache (a new request, a recompute, a freed row).
        ``prompt_len``: a recomputed request's prompt length (its tokens past it were sampled).

        A recompute normally prefills the prompt and the sampled tokens in one call, which gives
        what the calls of ``model.generate`` gave up to float rounding; where the start-up try
        found a prompt in two chunks does not give what it gives whole (XLNet's dummy token,
        Reformer), it is replayed instead: the prompt, then the sampled tokens one at a time."""
        self.single.pop(row, None)
        self.ids.pop(row, None)
        self.replays.pop(row, None)
        self.held.pop(row, None)
        if prompt_len is not None and not self.chunkable:
            self.replays[row] = prompt_len
        if row in self.batch_rows:
            self._leave([row])

    @property
    def batch_rows(self) -> list[int]:
        return self.batch.rows if self.batch is not None else []

    def copy(self, src: int, dst: int) -> None:
        """A child forks from its parent's cache."""
        self.reset(dst)
        self.single[dst] = copy.deepcopy(self._take(src))
        self.ids[dst] = self.ids[src].clone()
        if src in self.held:
            self.held[dst] = copy.deepcopy(self.held[src])

    def snapshot(self, taken: list[tuple[int, int, int]], num_new: list[int], rows: list[int]) -> None:
        """After a step's forward: for each ``(row, offset, slot)``, slot ``slot`` gets a copy of
        the row's cache and ids cut where the row's first ``offset`` tokens of this step end
        (``SchedulerOutput.snapshots``; a block boundary of its prompt)."""
        for row, offset, slot in taken:
            ids = self.ids[row]
            pos = int(ids.shape[1]) - num_new[rows.index(row)] + offset
            if row in self.batch_rows:
                assert self.batch is not None
                cache = self.batch.copy_of(row, self.batch.cache, pos)
            else:
                cache = _cut(_cache_of(self.single[row]), pos)
            self.snaps[slot] = ({"use_cache": True, "past_key_values": cache}, ids[:, :pos].clone())

    def restore(self, slot: int, row: int) -> None:
        """A prefix hit: the row's request goes on from a copy of slot ``slot``'s cache and ids
        (after the row was reset; before the step's forward)."""
        self.reset(row)
        kw, ids = self.snaps[slot]
        cache = kw["past_key_values"]
        self.single[row] = {**kw, "past_key_values": _cut(cache, _length(cache))}
        self.ids[row] = ids.clone()

    def clear(self) -> None:
        self.single.clear()
        self.ids.clear()
        self.replays.clear()
        self.held.clear()
        self.snaps.clear()  # (sleep drops the prefix cache, and the slots with it)
        self.batch = None

    def nbytes(self) -> int:
        from acb.runner.unpaged_layers import cache_nbytes

        own = sum(cache_nbytes(_cache_of(kw)) for kw in self.single.values())
        own += sum(cache_nbytes(_cache_of(kw)) for kw, _ in self.snaps.values())
        own += sum(ModuleState.nbytes(values) for values in self.held.values())
        return own + (self.batch.nbytes() if self.batch is not None else 0)

    # the batch ---------------------------------------------------------------
    def _empty(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _take(self, row: int) -> dict[str, Any]:
        """The row's generation state, its cache its own (taken out of the batch if it is there)."""
        if row in self.batch_rows:
            assert self.batch is not None
            own = self.batch.take(row, self.batch.cache)
            if not self.batch.rows:
                self.batch = None
            self.single[row] = {"use_cache": True, "past_key_values": own}
        return self.single[row]

    def _leave(self, rows: list[int]) -> None:
        """These rows leave the batch (their caches go)."""
        assert self.batch is not None
        self.batch.remove(rows)
        if not self.batch.rows:
            self.batch = None

    def _join(self, rows: list[int]) -> None:
        """Move these rows' own caches into the batch (all caches plain), padding on the left."""
        for r in rows:
            self._merge(self.single.pop(r)["past_key_values"], [0], [r])

    def _merge(self, cache: Any, pads: list[int], rows: list[int]) -> None:
        """A batch cache's rows (left-padded by ``pads``) join the decode batch."""
        if self.batch is None:
            self.batch = _DecodeBatch(cache)
        self.batch.add(cache, pads, rows)

    def _groups(
        self, segments: list[tuple[int, int, int]], want: dict[int, list[int]], logits_indices: list[int]
    ) -> list[list[tuple[int, int, int]]]:
        """The step's prefill segments that run as left-padded batches, in groups of like lengths.

        A segment of two or more tokens whose only wanted logits are its last token's (or none: a
        prompt's chunk) goes in a group when its request starts here (a new prompt, a recompute,
        a prompt's first chunk) or goes on from a plain cache of its own (a prompt's later chunk,
        a prefix hit), as ``model.generate``'s padded prefill with the rows' caches stacked,
        left-padded, before the new tokens. The new tokens are left-padded to the group's width,
        so a row that goes on from a cache must be as wide as its group, or padding would sit
        between its cache and its tokens: such a row heads a group, and the group's other rows
        attend over its cache's columns as padding. Sorted by length (and cache length), a row
        padded by more than a quarter of its group's width (and more than 32 tokens), counting
        those columns, starts a new group (padding costs a token's compute, or a column's
        attention, a group a pass over the weights). Fewer than two such segments in the step, or
        a group of one chunk: its own call."""
        if not self.batchable:
            return []
        cands: list[tuple[int, int, int, int]] = []  # (lo, hi, row, the length of its own cache)
        for lo, hi, row in segments:
            if hi - lo < 2 or row in self.replays or row in self.batch_rows:
                continue
            wanted = self._wanted(want, row, logits_indices)
            if row in self.single:  # goes on from its own cache
                if BATCH_PREFILL and self.group_chunks and wanted in ([], [hi - 1]) and self._plain_single(row):
                    cands.append((lo, hi, row, _length(_cache_of(self.single[row]))))
            elif wanted == [hi - 1] or (BATCH_PREFILL and not wanted):
                cands.append((lo, hi, row, 0))
        if len(cands) < 2:
            return []
        groups: list[list[tuple[int, int, int]]] = []
        group: list[tuple[int, int, int]] = []
        width = past = 0
        for lo, hi, row, own in sorted(cands, key=lambda c: (c[0] - c[1], -c[3])):
            if group and (
                (own and hi - lo != width) or own > past or width - (hi - lo) + past - own > max(32, width // 4)
            ):
                groups.append(group)
                group = []
            if not group:
                width, past = hi - lo, own
            group.append((lo, hi, row))
        groups.append(group)
        # (a lone new whole prompt still joins the batch this way; a lone chunk keeps its own cache)
        whole = {row for lo, hi, row, own in cands if not own and want.get(row)}
        return [g for g in groups if len(g) > 1 or g[0][2] in whole]

    def _prefill_batch(
        self,
        group: list[tuple[int, int, int]],
        input_ids: torch.Tensor,
        want: dict[int, list[int]],
        out: list[torch.Tensor | None],
    ) -> None:
        """A group's segments (:meth:`_groups`) as one left-padded batch, as ``model.generate``'s
        padded prefill (pads at position 0, masked): the caches of the rows that go on from one
        stacked, right-aligned, before the new tokens; the group's caches then join the decode
        batch."""
        lens = [hi - lo for lo, hi, _ in group]
        rows = [row for _, _, row in group]
        width = max(lens)
        own = {row: self.single.pop(row)["past_key_values"] for row in rows if row in self.single}
        pasts = [_length(own[row]) if row in own else 0 for row in rows]
        past = max(pasts)
        dev = input_ids.device
        ids = input_ids.new_zeros((len(group), width))
        pos = torch.zeros_like(ids)
        mask = input_ids.new_zeros((len(group), past + width))
        pads = []
        for i, (lo, hi, _) in enumerate(group):
            n, p = hi - lo, pasts[i]
            ids[i, width - n :] = input_ids[0, lo:hi]
            pos[i, width - n :] = torch.arange(p, p + n, device=dev)
            pads.append(past - p if p else past + width - n)  # (a row with a cache is as wide as the group)
            mask[i, pads[-1] :] = 1
        cache = self._stacked([own.get(row) for row in rows], pasts, past) if own else self._empty()
        logits = self._run(ids, pos, cache, mask, None)  # [B, V]: each row's last token
        for i, row in enumerate(rows):
            for j in want.get(row, []):
                out[j] = logits[i]
        self._merge(cache, pads, rows)

    def _stacked(self, caches: list[Any], pasts: list[int], past: int) -> Any:
        """One batch cache of plain layers, ``past`` columns wide: each row's own cache (or none)
        right-aligned, zeros on its left (padding, masked)."""
        like = next(c for c in caches if c is not None)
        kv = []
        for n, src in enumerate(like.layers):
            shape = (len(caches), src.keys.shape[1], past, src.keys.shape[3])
            keys, values = src.keys.new_zeros(shape), src.values.new_zeros(shape[:3] + (src.values.shape[3],))
            for i, (cache, p) in enumerate(zip(caches, pasts)):
                if cache is not None:
                    keys[i, :, past - p :] = cache.layers[n].keys[0]
                    values[i, :, past - p :] = cache.layers[n].values[0]
            kv.append((keys, values))
        return _plain_cache(like, kv)

    # a step ------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        num_new: list[int],
        rows: list[int],
        logits_indices: list[int],
    ) -> torch.Tensor:
        """The logits of the flattened batch's rows ``logits_indices``, ``[S, V]`` (in the
        batch-invariant mode, under its ops and attention: :func:`acb.runner.batch_invariant_own.mode_forward`)."""
        if not self.batch_invariant:
            return self._forward(input_ids, position_ids, num_new, rows, logits_indices)
        from acb.runner.batch_invariant_own import mode_forward

        with mode_forward(self.model):
            return self._forward(input_ids, position_ids, num_new, rows, logits_indices)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        num_new: list[int],
        rows: list[int],
        logits_indices: list[int],
    ) -> torch.Tensor:
        segments, lo = [], 0
        for n, row in zip(num_new, rows):
            segments.append((lo, lo + n, row))
            lo += n
        want: dict[int, list[int]] = {}  # row -> the indices of its logits in the output
        starts = [lo for lo, _, _ in segments]
        for j, t in enumerate(logits_indices):
            want.setdefault(segments[bisect.bisect_right(starts, t) - 1][2], []).append(j)
        out: list[torch.Tensor | None] = [None] * len(logits_indices)
        decode = [
            (lo, row)
            for lo, hi, row in segments
            if hi - lo == 1 and self.batchable and (row in self.batch_rows or self._plain_single(row))
        ]
        decode_rows = {row for _, row in decode}
        if len(decode) < 2:
            decode, decode_rows = [], set()
        # rows leaving the batch: scheduled otherwise, or not scheduled at all this step (they
        # stay out until their next decode, so the batch holds only this step's decode rows)
        leaving = [r for r in self.batch_rows if r not in decode_rows]
        for r in leaving:
            self._take(r)
        # prefill segments in left-padded groups (new prompts, first chunks, and resumed chunks
        # of rows whose own caches are plain; see _groups), two or more of them
        groups = self._groups(segments, want, logits_indices)
        fresh_rows = {row for group in groups for _, _, row in group}
        for lo, hi, row in segments:
            self._extend(row, input_ids[:, lo:hi])
            if row in decode_rows or row in fresh_rows:
                continue
            keep = [t - lo for t in self._wanted(want, row, logits_indices)]
            logits = self._single(row, hi - lo, keep)
            for j, lg in zip(want.get(row, []), logits):
                out[j] = lg
            cache = _cache_of(self.single[row])
            if self.batchable and getattr(cache, "layers", None) and not _plain(cache):
                self.batchable = False
                logger.info(
                    "%s's cache has layers other than plain growing K/V (%s): its decode rows run one at a time",
                    type(self.model).__name__,
                    sorted({type(layer).__name__ for layer in cache.layers}),
                )
        if decode:
            joining = [row for _, row in decode if row not in self.batch_rows]
            if joining:  # (each copied into a free row of the batch)
                self._join(joining)
            assert self.batch is not None
            order = {row: i for i, row in enumerate(self.batch.rows)}
            at = [0] * len(order)
            for lo, row in decode:
                at[order[row]] = lo
            index = torch.tensor(at, dtype=torch.long, device=input_ids.device)
            ids = input_ids[0, index].unsqueeze(1)  # [B, 1]
            pos = position_ids[0, index].unsqueeze(1)
            mask = self.batch.mask(input_ids.device)
            logits = self._run(ids, pos, self.batch.cache, mask, None)  # [B, V]
            for _, row in decode:
                for j in want.get(row, []):
                    out[j] = logits[order[row]]
        # after the decode rows ran: the groups' rows join the batch for the next step
        for group in groups:
            self._prefill_batch(group, input_ids, want, out)
        if self.module_state is not None:  # the user's model as it was between steps (a trainer's own forward)
            self.module_state.restore(None)
        return torch.stack([t for t in out if t is not None]) if out else input_ids.new_empty((0, 0)).float()

    @staticmethod
    def _wanted(want: dict[int, list[int]], row: int, logits_indices: list[int]) -> list[int]:
        return [logits_indices[j] for j in want.get(row, [])]

    def _plain_single(self, row: int) -> bool:
        kw = self.single.get(row)
        cache = _cache_of(kw) if kw is not None else None
        return cache is not None and _plain(cache) and _length(cache) > 0

    def _extend(self, row: int, ids: torch.Tensor) -> None:
        """The request's tokens so far, with this step's."""
        prev = self.ids.get(row)
        self.ids[row] = ids.clone() if prev is None else torch.cat([prev, ids], dim=1)

    def _single(self, row: int, n: int, keep: list[int]) -> torch.Tensor:
        """One request's ``n`` new tokens through the model's own generation hooks, on its own
        generation state; the logits of its tokens ``keep`` (``[len(keep), V]``)."""
        prompt = self.replays.pop(row, None)
        full = self.ids[row]
        if prompt is None or row in self.single or full.shape[1] != n or not 0 < prompt < n:
            return self._call(row, n, keep)
        # a recompute replayed: the prompt, then one call per sampled token
        parts, lo = [], 0
        for hi in [prompt, *range(prompt + 1, n + 1)]:
            self.ids[row] = full[:, :hi]
            parts.append(self._call(row, hi - lo, [t - lo for t in keep if lo <= t < hi]))
            lo = hi
        self.ids[row] = full
        return torch.cat(parts)

    def _call(self, row: int, n: int, keep: list[int]) -> torch.Tensor:
        """One call of the model's forward through its generation hooks (see :meth:`_single`)."""
        model = self.model
        ids = self.ids[row]
        kw = self.single.get(row)
        first = kw is None
        if kw is None:
            kw = {"use_cache": True, **self._new_cache()}
        if self._pass_positions:  # as model.generate hands them to a model whose forward takes them
            kw["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None]
        inputs = model.prepare_inputs_for_generation(
            ids, next_sequence_length=None if first else n, is_first_iteration=first, **kw
        )
        if self._keep and "logits_to_keep" not in inputs:  # the tail of the segment the wanted rows are in
            inputs["logits_to_keep"] = n - min(keep, default=n - 1)
        # counted from the end: the model may return logits for fewer or more positions
        picked = [t - n for t in keep]
        state = self.module_state
        if state is not None:  # the request's own values of the model's module state (None: a new request's)
            state.restore(None if first else self.held.get(row))
        outputs = model(**inputs, return_dict=True)
        if state is not None:
            self.held[row] = state.save()
        self.single[row] = model._update_model_kwargs_for_generation(
            outputs, kw, is_encoder_decoder=bool(getattr(self.config, "is_encoder_decoder", False)), num_new_tokens=n
        )
        logits = outputs.logits[0]
        return logits[picked] if keep else logits[:0]

    def _new_cache(self) -> dict[str, Any]:
        """The cache ``model.generate`` hands a request's first call, under the name it uses (none
        for a model that makes its own in its generation hooks). A model that does not return its
        cache (RecurrentGemma) keeps this one: without it, each call would start from nothing."""
        model = self.model
        supports = getattr(model, "_supports_default_dynamic_cache", None)
        if getattr(self.config, "is_encoder_decoder", False) or supports is None or not supports():
            return {}
        from transformers import DynamicCache

        name = "cache_params" if "mamba" in type(model).__name__.lower() else "past_key_values"
        return {name: DynamicCache(config=self.config.get_text_config(decoder=True))}

    def _run(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache: Any,
        mask: torch.Tensor | None,
        keep: list[int] | None,
    ) -> torch.Tensor:
        """The model's forward on its own cache: for a batch (``keep`` None) each row's last
        logits ``[B, V]``; for one request the logits of its tokens ``keep`` ``[len(keep), V]``."""
        kw: dict[str, Any] = dict(input_ids=ids, past_key_values=cache, use_cache=True)
        if self._positions:
            kw["position_ids"] = pos
        if mask is not None:
            kw["attention_mask"] = mask
        if keep is None:
            if self._keep:
                kw["logits_to_keep"] = 1
            return self.model(**kw).logits[:, -1]
        if not keep:
            if self._keep:
                kw["logits_to_keep"] = 1
            self.model(**kw)
            return ids.new_empty((0, 0)).float()
        if self._keep:
            kw["logits_to_keep"] = torch.tensor(keep, dtype=torch.long, device=ids.device)
            return self.model(**kw).logits[0]
        return self.model(**kw).logits[0, keep]
