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
  real positions. The batch is rebuilt only when rows join (a prompt done) or leave (finished,
  cancelled, preempted, or scheduled for more than one token), by stacking and slicing the
  layers' tensors, and trimmed of padding columns no row needs;
* **prefill chunks and every other segment** run one request at a time on its own cache
  (whole or chunked prefill, scoring continuations, a fork's own tokens), through the model's
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

Lifecycle: a request given a row starts with no cache (new, or recomputed after a preemption);
children of ``n > 1`` fork a deep copy of the parent's; a freed row's cache goes at once. No
pages, no prefix caching, no offload, no decode graphs.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _dynamic_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def _plain(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain growing K/V layer (batchable by stacking)."""
    layers: Any = getattr(cache, "layers", None)
    cls = _dynamic_layer_class()
    return bool(layers) and all(type(layer) is cls and getattr(layer, "is_initialized", False) for layer in layers)


def _growing_layer_class() -> type:
    """``DynamicLayer`` whose update appends in place, into buffers with room to spare (the
    decode batch's cache: a step costs its new column, not a copy of every cached one as
    ``torch.cat`` does); ``keys`` and ``values`` are views of the filled part."""
    global _GROWING
    if _GROWING is not None:
        return _GROWING
    base = _dynamic_layer_class()

    class GrowingLayer(base):  # type: ignore[misc, valid-type]
        def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            self.lazy_initialization(keys, values)
            n = keys.shape[2]
            room = n + max(16, n // 2)
            self._k = keys.new_empty((*keys.shape[:2], room, keys.shape[3]))
            self._v = values.new_empty((*values.shape[:2], room, values.shape[3]))
            self._k[:, :, :n] = keys
            self._v[:, :, :n] = values
            self._n = n
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            n, add = self._n, key_states.shape[2]
            if n + add > self._k.shape[2]:  # out of room: 1.5x, once in a while
                self.fill(self.keys, self.values)
            self._k[:, :, n : n + add] = key_states
            self._v[:, :, n : n + add] = value_states
            self._n = n + add
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
            return self.keys, self.values

    _GROWING = GrowingLayer
    return GrowingLayer


_GROWING: type | None = None


_DEAD = -(1 << 40)  # a batch row whose request left (acb's rows are >= 0; the start-up tries' small negatives)


def _length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _cache_of(kw: dict[str, Any]) -> Any:
    """The cache in a request's generation state (whatever the model names it)."""
    for name in ("past_key_values", "cache_params", "state"):
        if kw.get(name) is not None:
            return kw[name]
    return None


class OwnForward:
    """Runs engine steps on the model's own caches (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
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
        self.batch: Any = None  # the decode batch's cache (left-padded), or None
        self.batch_rows: list[int] = []
        self.batch_pad: list[int] = []  # left padding of each batch row
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
        self._probe()

    # start-up tries ------------------------------------------------------------
    def _probe(self) -> None:
        """Try what the model's own code is assumed to do, on scratch rows, once at start: a
        prompt prefilled in two chunks must give what it gives whole (ProphetNet's cache takes
        one token at a time after the first call), and two requests decoded as one padded batch
        what they give one at a time (GIT's mask does not follow left padding). What fails the
        try is not done: prompts are prefilled whole, decode rows run one at a time."""
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

        with torch.no_grad():
            for pass_positions in (True, False):  # a prompt, then a token: with position ids, else without
                if not pass_positions:
                    self._pass_positions = False
                try:
                    run([([-7], [12], [tokens[:, :12]]), ([-7], [1], [tokens[:, 12:13]])])
                    break
                except Exception:  # noqa: BLE001 - tried again without them, then left to the requests
                    self.reset(-7)
            if self.chunkable:
                try:
                    whole = run([([-1], [12], [tokens[:, :12]])])
                    chunked = run([([-2], [7], [tokens[:, :7]]), ([-2], [5], [tokens[:, 7:12]])])
                    self.chunkable = close(chunked, whole)
                except Exception:  # noqa: BLE001 - a cache that cannot take a chunk: prefill whole
                    self.chunkable = False
            if self.batchable:
                a, b = tokens[:, :5], tokens[:, 5:14]
                try:  # (the prompts prefilled as one padded batch, then decoded as one)
                    batched = [run([([-3, -4], [5, 9], [a, b])])]
                    batched.append(run([([-3, -4], [1, 1], [tokens[:, 5:6], tokens[:, 1:2]])]))
                    self.batchable = False
                    single = [run([([-5, -6], [5, 9], [a, b])])]
                    single.append(run([([-5, -6], [1, 1], [tokens[:, 5:6], tokens[:, 1:2]])]))
                    self.batchable = all(close(x, y) for x, y in zip(batched, single))
                except Exception:  # noqa: BLE001 - a cache that cannot be stacked: one row at a time
                    self.batchable = False
        for row in range(-7, 0):
            self.reset(row)

    # lifecycle ---------------------------------------------------------------
    def reset(self, row: int) -> None:
        """The row's request starts with no cache (a new request, a recompute, a freed row)."""
        self.single.pop(row, None)
        self.ids.pop(row, None)
        if row in self.batch_rows:
            self._leave([row])

    def copy(self, src: int, dst: int) -> None:
        """A child forks from its parent's cache."""
        self.reset(dst)
        self.single[dst] = copy.deepcopy(self._take(src))
        self.ids[dst] = self.ids[src].clone()

    def clear(self) -> None:
        self.single.clear()
        self.ids.clear()
        self.batch, self.batch_rows, self.batch_pad = None, [], []

    def nbytes(self) -> int:
        from acb.runner.own_cache import cache_nbytes

        own = sum(cache_nbytes(_cache_of(kw)) for kw in self.single.values())
        return own + (cache_nbytes(self.batch) if self.batch else 0)

    # the batch ---------------------------------------------------------------
    def _empty(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _take(self, row: int) -> dict[str, Any]:
        """The row's generation state, its cache its own (taken out of the batch if it is there)."""
        if row in self.batch_rows:
            i = self.batch_rows.index(row)
            own = self._slice(i)
            self._leave([row])
            self.single[row] = {"use_cache": True, "past_key_values": own}
        return self.single[row]

    def _like(self, cache: Any, layer_class: type | None = None) -> Any:
        """A cache object of the model's own, shaped as ``cache`` (its layers fresh and empty)."""
        out = copy.copy(cache)
        out.layers = [(layer_class or _dynamic_layer_class())() for _ in cache.layers]
        return out

    def _slice(self, i: int) -> Any:
        """Batch row ``i``'s cache, without its padding, as a new cache of one request."""
        pad = self.batch_pad[i]
        out = self._like(self.batch)
        for src, dst in zip(self.batch.layers, out.layers):
            dst.lazy_initialization(src.keys, src.values)
            dst.keys = src.keys[i : i + 1, :, pad:].clone()
            dst.values = src.values[i : i + 1, :, pad:].clone()
        return out

    def _leave(self, rows: list[int]) -> None:
        """These rows leave the batch: marked dead (their slots still decode, into nothing) until
        the next rebuild drops them, or until dead rows are as many as live ones; copying the
        whole batch at every finished request would cost more than the dead rows' compute."""
        self.batch_rows = [_DEAD if r in rows else r for r in self.batch_rows]
        live = sum(r != _DEAD for r in self.batch_rows)
        if not live:
            self.batch, self.batch_rows, self.batch_pad = None, [], []
        elif 2 * live <= len(self.batch_rows):
            self._compact()

    def _compact(self) -> None:
        """Drop the dead rows from the batch (a copy of the live ones)."""
        keep = [i for i, r in enumerate(self.batch_rows) if r != _DEAD]
        index = torch.tensor(keep, dtype=torch.long, device=self.batch.layers[0].keys.device)
        pads = [self.batch_pad[i] for i in keep]
        trim = min(pads)  # padding columns no remaining row needs
        for layer in self.batch.layers:
            layer.fill(layer.keys.index_select(0, index)[:, :, trim:], layer.values.index_select(0, index)[:, :, trim:])
        self.batch_rows = [self.batch_rows[i] for i in keep]
        self.batch_pad = [p - trim for p in pads]

    def _join(self, rows: list[int]) -> None:
        """Move these rows' own caches into the batch (all caches plain), padding on the left."""
        self._merge([(self.single.pop(r)["past_key_values"], [0], [r]) for r in rows])

    def _merge(self, parts: list[tuple[Any, list[int], list[int]]]) -> None:
        """Add caches to the batch: each part a cache, its rows' left padding, and those rows;
        all are padded on the left to the widest, and stacked."""
        if self.batch is not None:
            if _DEAD in self.batch_rows:  # (a rebuild drops them anyway)
                self._compact()
            parts = [(self.batch, self.batch_pad, self.batch_rows), *parts]
        widths = [int(cache.layers[0].keys.shape[2]) for cache, _, _ in parts]
        width = max(widths)
        out = self._like(parts[0][0], _growing_layer_class())
        for n, dst in enumerate(out.layers):
            keys, values = [], []
            for (cache, _, _), w in zip(parts, widths):
                k, v = cache.layers[n].keys, cache.layers[n].values
                if w < width:
                    k = torch.nn.functional.pad(k, (0, 0, width - w, 0))
                    v = torch.nn.functional.pad(v, (0, 0, width - w, 0))
                keys.append(k)
                values.append(v)
            dst.fill(torch.cat(keys, dim=0), torch.cat(values, dim=0))
        self.batch = out
        self.batch_rows = [r for _, _, rows in parts for r in rows]
        self.batch_pad = [p + width - w for (_, pads, _), w in zip(parts, widths) for p in pads]

    def _prefill_batch(
        self,
        fresh: list[tuple[int, int, int]],
        input_ids: torch.Tensor,
        want: dict[int, list[int]],
        out: list[torch.Tensor | None],
    ) -> None:
        """Whole prompts of new requests as one left-padded batch, as ``model.generate``'s padded
        prefill (pads at position 0, masked); their caches then join the decode batch."""
        lens = [hi - lo for lo, hi, _ in fresh]
        width = max(lens)
        ids = input_ids.new_zeros((len(fresh), width))
        mask = torch.zeros_like(ids)
        pos = torch.zeros_like(ids)
        for i, (lo, hi, _) in enumerate(fresh):
            n = hi - lo
            ids[i, width - n :] = input_ids[0, lo:hi]
            mask[i, width - n :] = 1
            pos[i, width - n :] = torch.arange(n, device=ids.device)
        cache = self._empty()
        logits = self._run(ids, pos, cache, mask, None)  # [B, V]: each prompt's last token
        for i, (_, _, row) in enumerate(fresh):
            for j in want.get(row, []):
                out[j] = logits[i]
        self._merge([(cache, [width - n for n in lens], [row for _, _, row in fresh])])

    # a step ------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, T]
        position_ids: torch.Tensor,  # [1, T]
        num_new: list[int],
        rows: list[int],
        logits_indices: list[int],
    ) -> torch.Tensor:
        """The logits of the flattened batch's rows ``logits_indices``, ``[S, V]``."""
        segments, lo = [], 0
        for n, row in zip(num_new, rows):
            segments.append((lo, lo + n, row))
            lo += n
        want: dict[int, list[int]] = {}
        seg_of = {}
        for lo, hi, row in segments:
            for t in range(lo, hi):
                seg_of[t] = (lo, hi, row)
        for j, t in enumerate(logits_indices):
            want.setdefault(seg_of[t][2], []).append(j)
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
        leaving = [r for r in self.batch_rows if r not in decode_rows and r != _DEAD]
        for r in leaving:
            self._take(r)
        # new requests' whole prompts (their one sampled row the last), two or more: one padded prefill
        fresh = [
            (lo, hi, row)
            for lo, hi, row in segments
            if self.batchable
            and hi - lo > 1
            and row not in self.single
            and row not in self.batch_rows
            and self._wanted(want, row, logits_indices) == [hi - 1]
        ]
        if len(fresh) < 2:
            fresh = []
        fresh_rows = {row for _, _, row in fresh}
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
            if joining:  # (the batch is rebuilt only when rows join)
                self._join(joining)
            order = {row: i for i, row in enumerate(self.batch_rows) if row != _DEAD}
            at = [0] * len(self.batch_rows)  # (a dead row decodes the step's first token, into nothing)
            for lo, row in decode:
                at[order[row]] = lo
            index = torch.tensor(at, dtype=torch.long, device=input_ids.device)
            ids = input_ids[0, index].unsqueeze(1)  # [B, 1]
            pos = position_ids[0, index].unsqueeze(1)
            width = self.batch.layers[0].keys.shape[2]
            mask = torch.ones((len(at), width + 1), dtype=torch.long, device=input_ids.device)
            for i, pad in enumerate(self.batch_pad):
                mask[i, :pad] = 0
            logits = self._run(ids, pos, self.batch, mask, None)  # [B, V]
            for _, row in decode:
                for j in want.get(row, []):
                    out[j] = logits[order[row]]
        if fresh:  # after the decode rows ran: the new rows join the batch for the next step
            self._prefill_batch(fresh, input_ids, want, out)
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
        model = self.model
        ids = self.ids[row]
        kw = self.single.get(row)
        first = kw is None
        if kw is None:
            kw = {"use_cache": True}
        if self._pass_positions:  # as model.generate hands them to a model whose forward takes them
            kw["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None]
        inputs = model.prepare_inputs_for_generation(
            ids, next_sequence_length=None if first else n, is_first_iteration=first, **kw
        )
        if self._keep and "logits_to_keep" not in inputs:  # the tail of the segment the wanted rows are in
            inputs["logits_to_keep"] = n - min(keep, default=n - 1)
        # counted from the end: the model may return logits for fewer or more positions
        picked = [t - n for t in keep]
        outputs = model(**inputs, return_dict=True)
        self.single[row] = model._update_model_kwargs_for_generation(
            outputs, kw, is_encoder_decoder=bool(getattr(self.config, "is_encoder_decoder", False)), num_new_tokens=n
        )
        logits = outputs.logits[0]
        return logits[picked] if keep else logits[:0]

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
