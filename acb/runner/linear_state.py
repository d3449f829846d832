"""Hybrid models' linear-attention layers (Qwen3-Next, Qwen3.5: the gated delta rule): the
per-request recurrent state, kept beside the paged KV cache, and the interception that runs
the model's own layers over a continuous batch.

A linear-attention layer keeps, per sequence, a convolution state (the last ``conv_kernel_size``
columns of its mixed q/k/v projections) and a recurrent state (``[heads, k_dim, v_dim]``), which
the model's code reads and writes through a cache object (``cache_params.get_conv_state``,
``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``). The model's code
assumes one padded batch, where a row is a sequence. acb's batch is one flattened sequence of
many requests' tokens, so acb intercepts each linear layer's ``forward`` (as it intercepts
attention, without re-implementing the model): within an engine step, the layer's own forward
runs over the step's request segments in as few calls as exactness allows, with cache objects that
speak transformers' interface over those requests' states in :class:`LinearStates`
(:class:`_RequestCache`: one request; :class:`_BatchCache`: several, gathered and written back).
Outside an engine step (a trainer's own forward) the layer runs as it always did.

The calls of a step, per state layer:
- decode rows (one token each, with a state): one batched call, as model.generate's decoding;
- prefill segments that start with no state (a prompt's first chunk): a call each, which gives
  a prompt the bits model.generate gives it alone; left-padded as model.generate batches prompts
  (pads zeroed, and the layer's own padding mask where its forward takes one), a call per group
  of neighbouring lengths (:func:`_padded_groups`), only where a start-up try per layer class
  (:func:`batches_prefill`) finds the padded batch gives those very bits. No chunked form on CPU
  does (the gated delta rule, Mamba2's scan: measured, a padded group flipped a greedy token on a
  near-tie), so theirs keep a call each: the varlen kernels below are their way to fewer calls;
- segments that resume from a state (a chunked prefill's later chunks, a prefix hit's rest, a
  scoring request's continuations after its context): by length (no padding: pads would move the
  state), where the try finds it gives a call each's outputs to float rounding (a call each does
  not give the whole prompt's bits there either: the split moves the chunk boundaries); up to :data:`STEP_TOKENS` tokens (and Mamba1's, whose scan
  ignores a state, at any length) stepped a token at a time in the layer's decode form, every row
  of the length in each call (a chunked form pads a row to its chunk whatever its length); longer
  ones in one call, or a call each for a length of its own;
- a segment with a snapshot inside it: its own calls, split there (a snapshot at a segment's end
  is taken after its batched call).
``BATCH_PREFILL = False`` turns the prefill groups off (a call per prefill segment, decode rows
still batched): ``benchmarks/state_prefill_batch.py`` measures the two.

State lifecycle (by the request's persistent block-table row, never its position in the batch):
- a request given a row (new, or resumed after a preemption) starts with no state, as the
  model's own cache does at prefill (``reset``);
- chunked prefill carries the state from chunk to chunk (the cache object hands the previous
  chunk's state to the next);
- ``n > 1`` and scoring groups: children fork from the parent's state after the step that
  completes the parent's prompt (``SchedulerOutput.state_copies_after``, then ``copy``);
- prefix caching: the scheduler plans snapshots of a request's state at block boundaries of its
  prompt (``SchedulerOutput.snapshots``: row, offset in its segment, slot); the layer's own code
  then runs that segment in pieces split there, and the state after each piece is copied into a
  snapshot slot (rows past the request rows of :class:`LinearStates`). A prefix hit restores the
  snapshot of its last block into the request's row (``SchedulerOutput.restores``) and the
  prefill resumes from it, as a chunked prefill resumes from its previous chunk;
- preemption with offload copies the request's row of state to a host row beside its KV
  blocks (``SchedulerOutput.row_swap_out``) and back when it resumes (``row_swap_in``); without
  offload space it recomputes.

The model's torch code is the CPU reference (and the kernels it picks from the hub on GPU); a
varlen kernel over all segments at once (flash-linear-attention's ``cu_seqlens`` kernels: no
padding, resumed segments of any lengths together) is the GPU path to add.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from acb.runner.batch_invariant_flag import is_on
from acb.runner.intercept import Interception, code_names
from acb.runner.step import CURRENT, entered

# the cache interfaces a state layer speaks (transformers' linear-attention / SSM caches): a layer
# class whose own code calls one of these sets on its cache keeps a per-request state acb must hold.
# A convolution and a recurrent state (the gated delta rule, Mamba/Mamba2 mixers, Kimi's delta
# attention), a recurrent state alone under another name (MiniMax's lightning attention:
# get_linear_cache / set_linear_cache), or a convolution state alone (LFM2/LFM3's short conv)
STATE_INTERFACES = (
    frozenset({"get_conv_state", "get_recurrent_state", "update_recurrent_state"}),
    frozenset({"get_linear_cache", "set_linear_cache"}),
    frozenset({"get_conv_state", "update_conv_state"}),
)
STATE_INTERFACE = STATE_INTERFACES[0]


def _speaks_state_interface(cls: type) -> bool:
    """Whether the methods ``cls`` defines (not inherited from torch) read and write a
    per-request state through the cache interface (gated delta rule, Mamba/Mamba2 mixers, ...)."""
    names = code_names(cls)
    return any(interface <= names for interface in STATE_INTERFACES)


def conv_only(cls: type) -> bool:
    """Whether the layer class keeps a convolution state and nothing else (LFM's short conv)."""
    names = code_names(cls)
    return names >= STATE_INTERFACES[2] and not (names & {"get_recurrent_state", "get_linear_cache"})


def linear_layers(model: torch.nn.Module) -> list[Any]:
    """The model's state layers acb drives: modules with a ``layer_idx`` whose class speaks a
    cache interface of per-request states (:data:`STATE_INTERFACES`), found by what they do, not
    by a list of class names (empty for a plain attention model)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and _speaks_state_interface(type(m))
    ]


class LinearStates:
    """Each request row's conv and recurrent states, per linear layer (allocated at the first
    write, from the shapes the layer gives: ``[rows, conv_dim, kernel]`` and ``[rows, heads,
    k_dim, v_dim]``), and which layers of each row hold a state."""

    def __init__(
        self,
        rows: int,
        device: torch.device,
        conv_only: frozenset[int] = frozenset(),
        slots: int = 0,
        host_rows: int = 0,
    ) -> None:
        self.rows = rows  # request rows; snapshot slot ``s`` is row ``rows + s`` of each table
        self.slots = slots
        self.device = device
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.valid: list[set[int]] = [set() for _ in range(rows + slots)]
        # layers whose state is a convolution state alone (LFM's short conv): written means valid
        self.conv_only = conv_only
        # host rows (offload at preemption): per layer [host rows, ...], made at the first offload
        self.host_rows = host_rows
        self.host_conv: dict[int, torch.Tensor] = {}
        self.host_recurrent: dict[int, torch.Tensor] = {}
        self.host_valid: list[set[int]] = []

    def keep_host_rows(self, other: LinearStates) -> None:
        """Take ``other``'s host rows (sleep rebuilds the device states; offloaded rows stay)."""
        self.host_rows, self.host_valid = other.host_rows, other.host_valid
        self.host_conv, self.host_recurrent = other.host_conv, other.host_recurrent

    def swap_out(self, row: int, host: int) -> None:
        """A preempted request's state to host row ``host`` (before its row is reused)."""
        if not self.host_valid:
            self.host_valid = [set() for _ in range(self.host_rows)]
        pin = self.device.type == "cuda"
        for table, dst in ((self.conv, self.host_conv), (self.recurrent, self.host_recurrent)):
            for layer in self.valid[row]:
                if layer in table:
                    if layer not in dst:
                        t = table[layer]
                        dst[layer] = torch.zeros((self.host_rows, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                    dst[layer][host].copy_(table[layer][row])
        self.host_valid[host] = set(self.valid[row])

    def swap_in(self, host: int, row: int) -> None:
        """A resumed request's state back from host row ``host``."""
        for table, src in ((self.conv, self.host_conv), (self.recurrent, self.host_recurrent)):
            for layer in self.host_valid[host]:
                if layer in src:
                    table[layer][row].copy_(src[layer][host], non_blocking=True)
        self.valid[row] = set(self.host_valid[host])

    def reset(self, row: int) -> None:
        """The row's request starts with no state (a new request, or a recompute)."""
        self.valid[row].clear()

    def copy(self, src: int, dst: int) -> None:
        """A child forks from its parent's state."""
        for layer in self.valid[src]:
            for table in (self.conv, self.recurrent):
                if layer in table:
                    table[layer][dst].copy_(table[layer][src])
        self.valid[dst] = set(self.valid[src])

    def snapshot(self, layer: int, row: int, slot: int) -> None:
        """Copy ``layer``'s state of ``row`` (as it is now, mid-forward) into snapshot ``slot``."""
        dst = self.rows + slot
        for table in (self.conv, self.recurrent):
            if layer in table:
                table[layer][dst].copy_(table[layer][row])
        if layer in self.valid[row]:
            self.valid[dst].add(layer)

    def clear_slot(self, slot: int) -> None:
        """A snapshot is about to be taken into ``slot``: what it held is gone."""
        self.valid[self.rows + slot].clear()

    def restore(self, slot: int, row: int) -> None:
        """A prefix hit: ``row``'s request resumes from the state in snapshot ``slot``."""
        self.copy(self.rows + slot, row)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv.values(), *self.recurrent.values()))

    def bytes_per_request(self) -> int:
        return self.nbytes() // max(self.rows + self.slots, 1)

    def _buffer(self, table: dict[int, torch.Tensor], layer: int, like: torch.Tensor) -> torch.Tensor:
        buf = table.get(layer)
        if buf is None:
            shape = (self.rows + self.slots, *like.shape[1:])
            buf = table[layer] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return buf


class _RequestCache:
    """transformers' linear-attention cache interface over one request's states (batch of one)."""

    __slots__ = ("states", "row")

    def __init__(self, states: LinearStates, row: int) -> None:
        self.states = states
        self.row = row

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        valid = self.states.valid[self.row]
        return bool(valid) if layer_idx is None else layer_idx in valid

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if layer_idx not in self.states.valid[self.row]:
            return None
        return self.states.conv[layer_idx][self.row : self.row + 1]  # a view: decode updates it in place

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if layer_idx not in self.states.valid[self.row]:
            return None
        return self.states.recurrent[layer_idx][self.row : self.row + 1]

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The columns the causal convolution needs (the kept state, then ``conv_states``);
        keeps the last ``conv_kernel_size`` of them (as transformers' cache does)."""
        k = int(conv_kernel_size or conv_states.shape[-1])
        if layer_idx in self.states.valid[self.row]:
            full = torch.cat([self.states.conv[layer_idx][self.row : self.row + 1], conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        buf = self.states._buffer(self.states.conv, layer_idx, full[..., -k:])
        buf[self.row].copy_(full[0, :, -k:])
        if layer_idx in self.states.conv_only:
            self.states.valid[self.row].add(layer_idx)
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        buf = self.states._buffer(self.states.recurrent, layer_idx, recurrent_states)
        buf[self.row].copy_(recurrent_states[0])
        self.states.valid[self.row].add(layer_idx)
        return buf[self.row : self.row + 1]

    # MiniMax's names for a recurrent state (its lightning attention's K^T V sum)
    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.get_recurrent_state(layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)


class _BatchCache:
    """The same interface over several requests' states at once, for one batched call of the
    layer: rows that all hold a state (decode rows, one token each; resumed prefill segments of one
    length), gathered into a batch for the layer's batched kernels, or rows that all start with
    none (``fresh``: first chunks of prompts, left-padded); written back after (:meth:`scatter`)."""

    __slots__ = ("states", "rows", "index", "conv", "recurrent", "fresh")

    def __init__(self, states: LinearStates, rows: list[int], layer: int, index: torch.Tensor, fresh: bool) -> None:
        self.states = states
        self.rows = rows
        self.index = index  # the rows, on the device
        self.fresh = fresh
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        if not fresh:
            # (decode updates the conv state in place) a layer may keep one of the two only
            conv, rec = states.conv.get(layer), states.recurrent.get(layer)
            self.conv = conv.index_select(0, index) if conv is not None else None
            self.recurrent = rec.index_select(0, index) if rec is not None else None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.recurrent

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.recurrent = linear_cache

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """As :meth:`_RequestCache.update_conv_state`, row by row (a fresh batch is left-padded,
        so each row's last columns are its own)."""
        if self.conv is not None:
            full = torch.cat([self.conv, conv_states], dim=-1)
            k = self.conv.shape[-1]
        else:
            k = int(conv_kernel_size or conv_states.shape[-1])
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        self.conv = full[..., -k:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states

    def scatter(self, layer: int) -> None:
        states = self.states
        if self.conv is not None:
            states._buffer(states.conv, layer, self.conv).index_copy_(0, self.index, self.conv)
        if self.recurrent is not None:
            rec = states._buffer(states.recurrent, layer, self.recurrent)
            rec.index_copy_(0, self.index, self.recurrent.to(rec.dtype))
        if self.fresh and (self.recurrent is not None or (self.conv is not None and layer in states.conv_only)):
            for row in self.rows:
                states.valid[row].add(layer)


class _Step:
    __slots__ = ("states", "segments", "snapshots", "plans", "groups")

    def __init__(
        self,
        states: LinearStates,
        segments: list[tuple[int, int, int]],
        snapshots: dict[int, list[tuple[int, int]]],
    ) -> None:
        self.states = states
        self.segments = segments  # (first token, end, request row) of each request in the batch
        self.snapshots = snapshots  # row -> (offset in its segment, slot), in order
        self.plans: dict[tuple[tuple[int, int, int], ...], _Plan] = {}  # a batched group's, shared by the layers
        self.groups: dict[tuple[tuple[int, int, int], ...], list[list[tuple[int, int, int]]]] = {}  # _padded_groups'


class _Plan:
    """Where a batched group's tokens come from and go, made once per step and group on the host and
    copied to the device in one transfer (no sync: pinned, non-blocking). ``take`` ``[B, L]``: each
    padded row's tokens in the step (a left pad repeats its row's first token, and is zeroed by
    ``real``); ``dst``: the step positions of the real tokens, in the order ``src`` picks them from
    the ``[B * L]`` output (``src`` None: every position is real)."""

    __slots__ = ("rows", "index", "take", "real", "mask", "src", "dst")

    def __init__(self, segs: list[tuple[int, int, int]], device: torch.device) -> None:
        lens = [hi - lo for lo, hi, _ in segs]
        width, n = max(lens), len(segs)
        self.rows = [row for _, _, row in segs]
        offset = torch.arange(width)[None] - (width - torch.tensor(lens))[:, None]  # [B, L]: < 0 in a pad
        take = torch.tensor([s[0] for s in segs])[:, None] + offset.clamp(min=0)
        padded = min(lens) < width
        parts = [torch.tensor(self.rows), take.reshape(-1)]
        if padded:
            real = offset >= 0
            src = real.reshape(-1).nonzero()[:, 0]  # (a host tensor: no device sync)
            parts += [real.reshape(-1).long(), src, take.reshape(-1)[src]]
        packed = torch.cat(parts)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        views = list(packed.split([len(p) for p in parts]))
        self.index, flat = views[0], views[1]
        self.take = flat.view(n, width)
        self.real = self.mask = self.src = None
        self.dst = flat
        if padded:
            self.mask = views[2].view(n, width)  # the layer's padding mask, as model.generate gives it
            self.real = self.mask.bool()[..., None]
            self.src, self.dst = views[3], views[4]


# a left-padded call's cost, in tokens: its rows times its longest, plus this much for the call
# itself (the layer's per-call work: the gated delta rule's torch form steps through a chunk's 63
# rows in Python whatever the batch; on CPU a call of one 64-token row took 13 ms, of four 37 ms)
PAD_CALL_TOKENS = 32
# and at most this many rows (bounds a padded call's buffers: a chunked scan's intermediates grow
# with its rows times its chunk squared, 256 x 256 per head for Mamba2's torch scan)
PAD_GROUP_ROWS = 8


def _padded_groups(step: _Step, fresh: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """The fresh segments in left-padded groups of neighbouring lengths, at most
    :data:`PAD_GROUP_ROWS` each, at the least cost (padded tokens plus :data:`PAD_CALL_TOKENS` a
    call: a 256-token prompt and a 16-token one are not padded together); groups of two or more.
    A one-token segment keeps its own call: alone, its projections are a matrix-vector product,
    whose sums run in another order than a batch's (not the same bits). Once per step (the step's
    layers share it)."""
    key = tuple(fresh)
    known = step.groups.get(key)
    if known is not None:
        return known
    order = sorted((s for s in fresh if s[1] - s[0] > 1), key=lambda s: s[1] - s[0])
    lens = [hi - lo for lo, hi, _ in order]
    # cost[j]: the first j segments (by length) in groups; each group ends at its longest
    cost, cut = [0] + [0] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        cost[j], cut[j] = min(
            (cost[i] + PAD_CALL_TOKENS + (j - i) * lens[j - 1], i) for i in range(max(0, j - PAD_GROUP_ROWS), j)
        )
    groups, j = [], len(order)
    while j:
        if j - cut[j] > 1:
            groups.append(order[cut[j] : j])
        j = cut[j]
    step.groups[key] = groups
    return groups


def _batched(
    original: Any,
    cache_arg: str,
    masks: tuple[str, ...],
    hidden_states: torch.Tensor,
    extra: dict[str, Any],
    states: LinearStates,
    layer: int,
    plan: _Plan,
    fresh: bool,
    stepped: bool = False,
    per_token: tuple[bool, ...] | None = None,
) -> Any:
    """The layer's own forward once over a group of segments (``plan``): rows that all start with
    no state (``fresh``; left-padded, pads zeroed and masked with the layer's ``masks`` arguments,
    as model.generate batches prompts), or that all hold one (no pads: equal lengths; ``stepped``:
    a call per token, the layer's decode form, as model.generate's decoding). Returns the layer's
    output, ``[B, L, ...]`` per token; the group's rows of state are written back."""
    cache = _BatchCache(states, plan.rows, layer, plan.index, fresh)
    if stepped:
        outs = []
        for t in range(plan.take.shape[1]):
            at = plan.take[:, t : t + 1]
            outs.append(
                original(hidden_states[0, at], **{cache_arg: cache}, **{n: _take(v, at) for n, v in extra.items()})
            )
        cache.scatter(layer)
        return outs[0] if len(outs) == 1 else _cat(outs, per_token)
    x = hidden_states[0, plan.take]  # [B, L, hidden]
    if plan.real is not None:
        x = x.masked_fill(~plan.real, 0)
    args = {name: _take(v, plan.take) for name, v in extra.items()}
    if plan.mask is not None:
        args.update(dict.fromkeys(masks, plan.mask))
    out = original(x, **{cache_arg: cache}, **args)
    cache.scatter(layer)
    return out


@contextlib.contextmanager
def linear_step(
    states: LinearStates,
    num_new: list[int],
    rows: list[int],
    snapshots: list[tuple[int, int, int]] | tuple[()] = (),
) -> Iterator[None]:
    """Within the block, the intercepted linear layers of this thread's forward run per request
    (``num_new`` tokens each, in batch order, with the states of their ``rows``), and take the
    ``snapshots`` (row, offset in its segment, slot) of the step."""
    segments, lo = [], 0
    for n, row in zip(num_new, rows):
        segments.append((lo, lo + n, row))
        lo += n
    snaps: dict[int, list[tuple[int, int]]] = {}
    for row, offset, slot in snapshots:
        states.clear_slot(slot)
        snaps.setdefault(row, []).append((offset, slot))
    for at in snaps.values():
        at.sort()
    with entered("states", _Step(states, segments, snaps)):
        yield


def _call(original: Any, cache_arg: str, x: torch.Tensor, cache: Any, extra: dict[str, Any], at: Any) -> Any:
    """The layer's own forward on ``x`` with ``cache`` as its cache argument, no mask, and the
    other arguments it requires (``extra``: per-token tensors taken at ``at``, as ``x`` was)."""
    return original(x, **{cache_arg: cache}, **{name: _take(v, at) for name, v in extra.items()})


def _take(value: Any, at: Any) -> Any:
    """A per-token argument (``[1, T, ...]``, or a tuple of them: rotary cos/sin) for the tokens
    ``at`` selects: a segment (a slice, ``[1, n, ...]``) or a batched group's rows (an index
    ``[B, L]``, ``[B, L, ...]``)."""
    if isinstance(value, tuple):
        return tuple(_take(v, at) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    if isinstance(at, slice):
        return value[:, at]
    return value[0, at]


def _required(sig: inspect.Signature, cache_arg: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments besides the input and the cache that the layer's forward cannot do without
    (MiniMax's lightning attention: ``position_embeddings``, ``attention_mask``), from the call
    the model made: per-token tensors pass through :func:`_take`; a mask is dropped (None)."""
    params = list(sig.parameters.values())[2:]  # after self and the input
    need = [
        p
        for p in params
        if p.default is inspect.Parameter.empty
        and p.name != cache_arg
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if not need:
        return {}
    given = dict(zip([p.name for p in params], args[1:]))
    given.update(kwargs)
    return {p.name: None if "mask" in p.name else given.get(p.name) for p in need}


def _cat(outs: list[Any], per_token: tuple[bool, ...] | None) -> Any:
    """The per-segment outputs as one batch along the token dimension (a tuple: element-wise; an
    element that is not per token, per :func:`resumes_prefill`'s try, is None)."""
    if isinstance(outs[0], tuple):
        flags = per_token or (True,) * len(outs[0])
        return tuple(torch.cat(parts, dim=1) if f else None for parts, f in zip(zip(*outs), flags))
    return torch.cat(outs, dim=1)


# layer class -> whether each element of its forward's tuple output is per token (found by
# resumes_prefill's try: MiniMax's lightning attention also returns its state, which is not)
_PER_TOKEN: dict[type, tuple[bool, ...]] = {}
# layer classes whose multi-token form ignores a state it is handed (Mamba1's selective scan) but
# whose one-token form reads it (found by resumes_stepwise's try): a segment that starts from a
# state runs one token at a time, as model.generate's decoding does
STEPWISE: set[type] = set()
# the longest rest of a prompt such a layer steps through after a prefix hit: past it, the hit is
# not taken and the prompt is recomputed whole (benchmarks/mamba1_resume.py: on CPU stepping took
# 0.4-0.6x a recompute's time at 16-32 tokens after a 512-token prefix, 1.3x at 64, 4.5x at 256)
STEPWISE_MAX_TAIL = 32


# prefill segments batched, as decode rows are (False: one call of each state layer per prefill
# segment, as before; benchmarks/state_prefill_batch.py's A/B)
BATCH_PREFILL = True


class Batches(NamedTuple):
    """Which of a layer class's batched calls give what one call per segment gives
    (:func:`batches_prefill`'s answer)."""

    padded: bool  # fresh segments of different lengths, left-padded: the same bits
    resumed: bool  # segments resuming from a state, of one length: to float rounding
    stepped: bool  # those stepped a token at a time in the decode form: to float rounding


# layer class -> (which batched calls give a call per segment's bits, the forward's mask
# arguments), found by batches_prefill's try
_BATCHES: dict[tuple[type, bool], tuple[Batches, tuple[str, ...]]] = {}
# resumed segments of up to this many tokens (a scoring request's continuation after its context's
# state, a prefix hit's short rest) are stepped through in the layer's decode form, every row of a
# length together: a chunked form pads each row to its chunk (64 tokens for the gated delta rule,
# 256 for Mamba2's scan) whatever the row's length, a decode step costs a token
STEP_TOKENS = 8


def _forward(
    original: Any, module: Any, cache_arg: str, sig: inspect.Signature, cls: type, *args: Any, **kwargs: Any
) -> Any:
    step: _Step | None = CURRENT.states
    if step is None:  # not an engine step: the layer as it always was
        return original(*args, **kwargs)
    layer: int = module.layer_idx
    extra = _required(sig, cache_arg, args, kwargs)
    # the layer's input; its cache argument is replaced by this step's per-request states, and the
    # rest (acb's attention plumbing, transformers' flash kwargs, a padding mask) is not passed:
    # the layer's torch path needs none of it, and its conv kernel would take it for varlen arguments
    hidden_states = args[0] if args else kwargs["hidden_states"]
    states = step.states
    snaps = step.snapshots

    stepwise = cls in STEPWISE

    def run(a: int, b: int, row: int) -> Any:
        cache = _RequestCache(states, row)
        if stepwise and b - a > 1 and layer in states.valid[row]:  # resumed from a state: a token at a time
            outs = [
                _call(original, cache_arg, hidden_states[:, t : t + 1], cache, extra, slice(t, t + 1))
                for t in range(a, b)
            ]
            return _cat(outs, _PER_TOKEN.get(cls))
        return _call(original, cache_arg, hidden_states[:, a:b], cache, extra, slice(a, b))

    def segment(lo: int, hi: int, row: int) -> Any:
        """The layer's own code over one request's tokens ``[lo, hi)``, in pieces split where the
        step takes snapshots of the row's state."""
        at = snaps.get(row)
        if not at:
            return run(lo, hi, row)
        pieces, a = [], lo
        for offset, slot in at:
            b = lo + offset
            if b > a:
                pieces.append(run(a, b, row))
                a = b
            states.snapshot(layer, row, slot)
        if hi > a:
            pieces.append(run(a, hi, row))
        return pieces[0] if len(pieces) == 1 else _cat(pieces, _PER_TOKEN.get(cls))

    # the segments one call runs together, where the class's start-up try finds it exact: those
    # starting with no state, left-padded in groups of neighbouring lengths; those holding one, by
    # length: decode rows (one token each) in one call, up to STEP_TOKENS (Mamba1's: any length)
    # stepped together a token at a time in the decode form, longer ones in one call. A row taking
    # a snapshot inside its segment keeps its own calls, split there (one at its end is taken
    # after its group's call).
    fresh: list[tuple[int, int, int]] = []
    held: dict[int, list[tuple[int, int, int]]] = {}
    for seg in step.segments:
        lo, hi, row = seg
        if row in snaps and any(offset != hi - lo for offset, _ in snaps[row]):
            continue
        if layer not in states.valid[row]:
            fresh.append(seg)
        else:
            held.setdefault(hi - lo, []).append(seg)
    can = Batches(False, False, False)
    masks: tuple[str, ...] = ()
    if BATCH_PREFILL and (len(fresh) > 1 or any(n > 1 for n in held)):
        can, masks = _batches(module, hidden_states.shape[-1])
    # (segments, starting fresh, stepped a token at a time)
    groups = [(g, True, False) for g in _padded_groups(step, fresh)] if can.padded and len(fresh) > 1 else []
    for n, g in held.items():
        if n == 1:  # decode rows
            if len(g) > 1:
                groups.append((g, False, False))
        elif can.stepped and (n <= STEP_TOKENS or (stepwise and len(g) > 1)):
            groups.append((g, False, True))
        elif can.resumed and not stepwise and len(g) > 1:
            groups.append((g, False, False))
    if not groups:  # one call per request
        return _cat([segment(lo, hi, row) for lo, hi, row in step.segments], _PER_TOKEN.get(cls))
    per_token = _PER_TOKEN.get(cls)
    total = hidden_states.shape[1]
    outs: list[torch.Tensor | None] = []
    single = True
    done: set[int] = set()
    for segs, starts_fresh, steps in groups:
        key = tuple(segs)
        plan = step.plans.get(key)
        if plan is None:
            plan = step.plans[key] = _Plan(segs, hidden_states.device)
        got = _batched(
            original, cache_arg, masks, hidden_states, extra, states, layer, plan, starts_fresh, steps, per_token
        )
        for row in plan.rows:
            for _, slot in snaps.get(row, ()):  # (at the segment's end)
                states.snapshot(layer, row, slot)
        single = not isinstance(got, tuple)
        parts = (got,) if single else got
        if not outs:
            flags = (per_token or (True,) * len(parts)) if not single else (True,)
            outs = [
                torch.empty((1, total, *p.shape[2:]), dtype=p.dtype, device=p.device) if f else None
                for p, f in zip(parts, flags)
            ]
        for out, p in zip(outs, parts):
            if out is not None:  # [B, L, ...] -> the real tokens' places in the step
                flat = p.reshape(-1, *p.shape[2:])
                if plan.src is not None:
                    flat = flat.index_select(0, plan.src)
                out[0].index_copy_(0, plan.dst, flat.to(out.dtype))
        done.update(plan.rows)
    for lo, hi, row in step.segments:
        if row not in done:
            got = segment(lo, hi, row)
            for out, p in zip(outs, (got,) if single else got):
                if out is not None:
                    out[:, lo:hi] = p
    return outs[0] if single else tuple(outs)


def _cache_arg(layer: torch.nn.Module) -> str:
    """The name of the layer's cache argument (``cache_params`` for the SSM and gated-delta-rule
    layers; ``past_key_values`` for a projection inside an attention layer, Zaya's)."""
    return _cache_arg_of(type(layer))


class _Scratch:
    """A start-up try of one state layer alone: a scratch input of ``tokens`` tokens (random, or
    zeros), fresh one-row states, and the layer's own forward over a part of the input with them
    (the arguments the forward requires besides its input and cache are None: MiniMax's rotary
    embeddings and mask, which its lightning attention does not read)."""

    def __init__(
        self, layer: torch.nn.Module, param: torch.Tensor, tokens: int, hidden_size: int, random: bool
    ) -> None:
        self.layer = layer
        self.device = param.device
        if random:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(1, tokens, hidden_size, generator=g).to(param.device, param.dtype)
        else:
            self.x = torch.zeros(1, tokens, hidden_size, device=param.device, dtype=param.dtype)
        self.arg = _cache_arg(layer)
        self.extra = {name: None for name in _required(inspect.signature(type(layer).forward), self.arg, (self.x,), {})}
        self.conv_only = frozenset({int(layer.layer_idx)} if conv_only(type(layer)) else ())  # type: ignore[arg-type]

    @classmethod
    def of(cls, layer: torch.nn.Module, tokens: int, hidden_size: int, random: bool = True) -> _Scratch | None:
        param = next(layer.parameters(), None)
        return None if param is None else cls(layer, param, tokens, hidden_size, random)

    def states(self, rows: int = 1) -> LinearStates:
        return LinearStates(rows, self.device, self.conv_only)

    def run(self, x: torch.Tensor, states: LinearStates, row: int = 0) -> Any:
        with torch.no_grad():
            return self.layer(x, **{self.arg: _RequestCache(states, row)}, **self.extra)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The start-up tries' tolerance: the same outputs to float rounding of the other order."""
    want = want.float()
    return torch.allclose(got.float(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6)


def _bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The batched calls' standard: the very bits one call per segment gives."""
    return got.dtype == want.dtype and torch.equal(got, want)


def resumes_prefill(layer: torch.nn.Module, hidden_size: int) -> bool:
    """Whether ``layer`` continues a prefill from the state an earlier chunk left: the same tokens
    in two chunks give what they give whole. The gated delta rule and Mamba2's chunk scan take
    the state in; Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba) does not, so a model with
    such layers must prefill each prompt in one step. Tried once per layer class, at start, on
    a scratch state (a layer that fails the try is taken as one that cannot)."""
    t = _Scratch.of(layer, 12, hidden_size)
    if t is None:
        return False
    try:
        whole = t.run(t.x, t.states())
        kept = t.states()
        t.run(t.x[:, :7], kept)
        second = t.run(t.x[:, 7:], kept)
    except Exception:  # noqa: BLE001 - a layer that cannot run the try alone: prefill whole, to be safe
        return False
    pairs = list(zip(second, whole)) if isinstance(whole, tuple) else [(second, whole)]
    # an output is per token when its second dimension is the input's token count in both runs
    flags = tuple(
        isinstance(full, torch.Tensor) and full.dim() >= 2 and full.shape[1] == 12 and got.shape[1] == 5
        for got, full in pairs
    )
    if isinstance(whole, tuple):
        _PER_TOKEN[type(layer)] = flags
    # (an output that is not per token: MiniMax's returned state)
    return all(_close(got, full[:, 7:]) for (got, full), per_token in zip(pairs, flags) if per_token)


def state_row_bytes(layers: list[torch.nn.Module], hidden_size: int) -> int:
    """Bytes of one request's state over ``layers`` (conv and recurrent, as the layers' own code
    writes them: dtype included), measured by one 2-token call of each layer on a scratch state."""
    total = 0
    for layer in layers:
        t = _Scratch.of(layer, 2, hidden_size, random=False)
        if t is None:
            continue
        states = t.states()
        try:
            t.run(t.x, states)
        except Exception:  # noqa: BLE001 - a layer that cannot run alone: its state is not measured
            continue
        total += states.nbytes()
    return total


def resumes_stepwise(layer: torch.nn.Module, hidden_size: int) -> bool:
    """For a layer that cannot resume a prefill (:func:`resumes_prefill`): whether it resumes one
    token at a time, the rest of a prompt after a state taken as decode steps, to what the whole
    prompt gives (Mamba1: its one-token form reads the state its scan ignores). Such a layer's
    class joins :data:`STEPWISE`."""
    t = _Scratch.of(layer, 12, hidden_size)
    if t is None:
        return False
    try:
        whole = t.run(t.x, t.states())
        kept = t.states()
        t.run(t.x[:, :7], kept)
        steps = [t.run(t.x[:, i : i + 1], kept) for i in range(7, 12)]
    except Exception:  # noqa: BLE001 - a layer that cannot run the try alone
        return False
    if isinstance(whole, tuple):
        return False
    ok = _close(torch.cat(steps, dim=1), whole[:, 7:])
    if ok:
        STEPWISE.add(type(layer))
    return ok


def _mask_args(cls: Any) -> tuple[str, ...]:
    """The forward's padding-mask arguments (``attention_mask``; Zaya's ``conv_mask``)."""
    return tuple(name for name in list(inspect.signature(cls.forward).parameters)[1:] if "mask" in name)


def _states_match(a: LinearStates, b: LinearStates, layer: int, rows: int, match: Any = _close) -> bool:
    if any(a.valid[r] != b.valid[r] for r in range(rows)):
        return False
    for ta, tb in ((a.conv, b.conv), (a.recurrent, b.recurrent)):
        if (layer in ta) != (layer in tb):
            return False
        if layer in ta and not all(match(ta[layer][r], tb[layer][r]) for r in range(rows)):
            return False
    return True


def batches_prefill(layer: torch.nn.Module, hidden_size: int, exact: bool = False) -> Batches:
    """Whether one call of ``layer`` over several requests' prefill segments gives what one call per
    segment gives, for three groups: segments that start with no state, of different lengths,
    left-padded (pads zeroed and masked with the forward's own padding mask, as model.generate
    batches prompts; one shorter than a convolution kernel among them), to the bit; segments that
    resume from a state, of one length, in one call; and the same stepped a token at a time in the
    layer's decode form, to what each whole sequence gives (Mamba1's scan, which ignores a state,
    passes the third only). Tried once per layer class, on scratch states; a layer that fails a
    try, or cannot run it alone, keeps one call per segment there.

    Fresh prompts are held to the bit: a call each gives a prompt what model.generate gives it
    alone, and a greedy token on a near-tie follows the bits (measured: a padded group flipped a
    prompt's first token on logits 14.37548 against 14.37488). The chunked forms fail it, every
    one acb drives today on CPU (the gated delta rule, Mamba2's scan; the pads' decays enter the
    chunk's cumulative sums), and an unpadded batch of equal lengths would too: their batched
    triangular solves and matrix products, and the projections' at a few rows, sum in another order
    than a batch of one (measured on the gated delta rule: two 6-token prompts, or two 39-token
    ones, differ from a call each; two 8-token ones happen not to). Resumed segments are held to float
    rounding: a call each does not give the whole prompt's bits there either (the split moves the
    chunk boundaries). ``exact`` (the batch-invariant mode) holds all three to the bit."""
    cls = type(layer)
    near = _bitwise if exact else _close
    t = _Scratch.of(layer, 27, hidden_size)
    if t is None:
        return Batches(False, False, False)
    masks = _mask_args(cls)
    idx = int(layer.layer_idx)  # type: ignore[arg-type]
    fresh = [(0, 12, 0), (12, 17, 1), (17, 19, 2)]  # 12, 5 and 2 tokens
    resumed = [(19, 23, 0), (23, 27, 1)]  # 4 tokens each, after rows 0 and 1's first segments

    def alone(states: LinearStates, segs: list[tuple[int, int, int]]) -> list[Any]:
        return [t.run(t.x[:, lo:hi], states, row) for lo, hi, row in segs]

    def together(states: LinearStates, segs: list[tuple[int, int, int]], starts_fresh: bool, steps: bool) -> Any:
        with torch.no_grad():
            plan = _Plan(segs, t.device)
            return _batched(
                layer, t.arg, masks, t.x, t.extra, states, idx, plan, starts_fresh, steps, _PER_TOKEN.get(cls)
            )

    def same(want: list[Any], got: Any, segs: list[tuple[int, int, int]], match: Any) -> bool:
        width = max(hi - lo for lo, hi, _ in segs)
        for b, ((lo, hi, _), one) in enumerate(zip(segs, want)):
            pairs = list(zip(got, one, _PER_TOKEN[cls])) if isinstance(one, tuple) else [(got, one, True)]
            for g, w, per_token in pairs:
                if per_token and not (g.shape[:2] == (len(segs), width) and match(g[b, width - (hi - lo) :], w[0])):
                    return False
        return True

    def copy(states: LinearStates) -> LinearStates:
        out = t.states(3)
        for table, src in ((out.conv, states.conv), (out.recurrent, states.recurrent)):
            table.update({k: v.clone() for k, v in src.items()})
        out.valid = [set(v) for v in states.valid]
        return out

    try:
        with entered("states", None):  # (the try may run inside a step: the layer as it always was here)
            ref = t.states(3)
            want = alone(ref, fresh)
            if isinstance(want[0], tuple):  # which outputs are per token (12 and 5 of them)
                _PER_TOKEN.setdefault(
                    cls,
                    tuple(
                        all(
                            isinstance(w, torch.Tensor) and w.dim() >= 2 and w.shape[1] == n
                            for w, n in zip(ws, (12, 5))
                        )
                        for ws in zip(want[0], want[1])
                    ),
                )
            got_states = t.states(3)
            got = together(got_states, fresh, True, False)
            padded = same(want, got, fresh, _bitwise) and _states_match(got_states, ref, idx, 3, _bitwise)
            held, stepping = copy(ref), copy(ref)
            want = alone(ref, resumed)
            got = together(held, resumed, False, False)
            equal = same(want, got, resumed, near) and _states_match(held, ref, idx, 3, near)
            # the whole sequences (first segment, then the resumed one) in one call each
            whole = t.states(3)
            wants = []
            for (lo, hi, row), (a, b, _) in zip(fresh, resumed):
                out = t.run(torch.cat([t.x[:, lo:hi], t.x[:, a:b]], dim=1), whole, row)
                if isinstance(out, tuple):
                    wants.append(tuple(o[:, a - b :] if f else o for o, f in zip(out, _PER_TOKEN[cls])))
                else:
                    wants.append(out[:, a - b :])
            got = together(stepping, resumed, False, True)
            stepped = same(wants, got, resumed, near) and _states_match(stepping, whole, idx, 2, near)
    except Exception:  # noqa: BLE001 - a layer that cannot run the try alone: a call per segment, to be safe
        return Batches(False, False, False)
    return Batches(padded, equal, stepped)


def _batches(layer: torch.nn.Module, hidden_size: int) -> tuple[Batches, tuple[str, ...]]:
    """:func:`batches_prefill`'s answer for the layer's class (tried at its first use), and its
    forward's mask arguments; in the batch-invariant mode, tried apart and held to the bit."""
    cls = type(layer)
    exact = is_on()
    known = _BATCHES.get((cls, exact))
    if known is None:
        known = _BATCHES[(cls, exact)] = (batches_prefill(layer, hidden_size, exact), _mask_args(cls))
    return known


_CACHE_ARG: dict[type, str] = {}


def _cache_arg_of(cls: Any) -> str:
    arg = _CACHE_ARG.get(cls)
    if arg is None:
        params = inspect.signature(cls.forward).parameters  # (the class's: not acb's interception)
        arg = next((name for name in ("cache_params", "past_key_values", "cache") if name in params), "cache_params")
        _CACHE_ARG[cls] = arg
    return arg


def _intercepted(original: Any, sig: inspect.Signature, layer: Any, *args: Any, **kwargs: Any) -> Any:
    cls = type(layer)
    routed = cls.forward
    if getattr(routed, "acb_fixed", False) and getattr(original, "__func__", None) is not routed:
        # the batch-invariant mode routed the class's forward to its fixed form after this
        # interception took the layer's own (batch_invariant_families.install): take the routed one
        original = routed.__get__(layer)
    return _forward(original, layer, _cache_arg_of(cls), sig, cls, *args, **kwargs)


class LinearLayers(Interception):
    """The interception of a model's linear layers (installed for an engine's life)."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers = linear_layers(model)
        # layers keeping a convolution state alone: a write makes their state valid
        self.conv_only = frozenset(layer.layer_idx for layer in layers if conv_only(type(layer)))
        super().__init__(layers, _intercepted)
