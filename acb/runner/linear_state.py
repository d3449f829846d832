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
runs once per request segment of the batch, with a cache object (:class:`_RequestCache`) that
speaks transformers' interface over that request's state in :class:`LinearStates`. Outside an
engine step (a trainer's own forward) the layer runs as it always did.

State lifecycle (by the request's persistent block-table row, never its position in the batch):
- a request given a row (new, or resumed after a preemption) starts with no state, as the
  model's own cache does at prefill (``reset``);
- chunked prefill carries the state from chunk to chunk (the cache object hands the previous
  chunk's state to the next);
- ``n > 1`` and scoring groups: children fork from the parent's state after the step that
  completes the parent's prompt (``SchedulerOutput.state_copies_after``, then ``copy``);
- preemption recomputes (the state cannot be rebuilt from offloaded KV blocks: offload is off
  for hybrid models), and prefix caching is off (a cached prefix has KV but no state; states
  snapshotted at block boundaries would be the alternative, at ``[heads, k, v]`` floats per
  layer per block).

One Python loop over the batch's requests per linear layer per step: the model's torch code is
the CPU reference (and the kernels it picks from the hub on GPU); a varlen kernel over all
segments at once (flash-linear-attention's ``cu_seqlens`` kernels) is the GPU path to add.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch

# the cache interface a state layer speaks (transformers' linear-attention / SSM cache): a layer
# class whose own code calls these on its cache keeps a per-request state acb must hold
STATE_INTERFACE = frozenset({"get_conv_state", "get_recurrent_state", "update_recurrent_state"})

_STEP = threading.local()


_SPEAKS: dict[type, bool] = {}


def _speaks_state_interface(cls: type) -> bool:
    """Whether the methods ``cls`` defines (not inherited from torch) read and write a
    per-request state through the cache interface (gated delta rule, Mamba/Mamba2 mixers, ...)."""
    known = _SPEAKS.get(cls)
    if known is not None:
        return known
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch."):
            break
        for fn in vars(klass).values():
            code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
            if code is not None:
                names.update(code.co_names)
    _SPEAKS[cls] = STATE_INTERFACE <= names
    return _SPEAKS[cls]


def linear_layers(model: torch.nn.Module) -> list[Any]:
    """The model's state layers acb drives: modules with a ``layer_idx`` whose class speaks the
    cache interface of per-request states (:data:`STATE_INTERFACE`), found by what they do, not
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

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.valid: list[set[int]] = [set() for _ in range(rows)]

    def reset(self, row: int) -> None:
        """The row's request starts with no state (a new request, or a recompute)."""
        self.valid[row].clear()

    def copy(self, src: int, dst: int) -> None:
        """A child forks from its parent's state."""
        for layer in self.valid[src]:
            self.conv[layer][dst].copy_(self.conv[layer][src])
            self.recurrent[layer][dst].copy_(self.recurrent[layer][src])
        self.valid[dst] = set(self.valid[src])

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv.values(), *self.recurrent.values()))

    def bytes_per_request(self) -> int:
        return self.nbytes() // max(self.rows, 1)

    def _buffer(self, table: dict[int, torch.Tensor], layer: int, like: torch.Tensor) -> torch.Tensor:
        buf = table.get(layer)
        if buf is None:
            buf = table[layer] = torch.zeros((self.rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
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
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        buf = self.states._buffer(self.states.recurrent, layer_idx, recurrent_states)
        buf[self.row].copy_(recurrent_states[0])
        self.states.valid[self.row].add(layer_idx)
        return buf[self.row : self.row + 1]


class _BatchCache:
    """The same interface over several requests' states at once (decode rows: one token each,
    every one with a state): gathered into a batch for the layer's batched kernels, written back
    after (:meth:`scatter`)."""

    __slots__ = ("states", "rows", "index", "conv", "recurrent")

    def __init__(self, states: LinearStates, rows: list[int], layer: int) -> None:
        self.states = states
        self.rows = rows
        self.index = torch.tensor(rows, dtype=torch.long, device=states.conv[layer].device)
        self.conv = states.conv[layer].index_select(0, self.index)  # decode updates it in place
        self.recurrent = states.recurrent[layer].index_select(0, self.index)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv = full[..., -self.conv.shape[-1] :].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent = recurrent_states
        return recurrent_states

    def scatter(self, layer: int) -> None:
        self.states.conv[layer].index_copy_(0, self.index, self.conv)
        self.states.recurrent[layer].index_copy_(0, self.index, self.recurrent.to(self.states.recurrent[layer].dtype))


class _Step:
    __slots__ = ("states", "segments")

    def __init__(self, states: LinearStates, segments: list[tuple[int, int, int]]) -> None:
        self.states = states
        self.segments = segments  # (first token, end, request row) of each request in the batch


@contextlib.contextmanager
def linear_step(states: LinearStates, num_new: list[int], rows: list[int]) -> Iterator[None]:
    """Within the block, the intercepted linear layers of this thread's forward run per request
    (``num_new`` tokens each, in batch order, with the states of their ``rows``)."""
    segments, lo = [], 0
    for n, row in zip(num_new, rows):
        segments.append((lo, lo + n, row))
        lo += n
    prev = getattr(_STEP, "step", None)
    _STEP.step = _Step(states, segments)
    try:
        yield
    finally:
        _STEP.step = prev


def _call(original: Any, cache_arg: str, x: torch.Tensor, cache: Any) -> Any:
    """The layer's own forward on ``x`` with ``cache`` as its cache argument and no mask."""
    return original(x, **{cache_arg: cache})


def _cat(outs: list[Any]) -> Any:
    """The per-segment outputs as one batch along the token dimension (a tuple: element-wise)."""
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))
    return torch.cat(outs, dim=1)


def _forward(original: Any, layer: int, cache_arg: str, *args: Any, **kwargs: Any) -> Any:
    step: _Step | None = getattr(_STEP, "step", None)
    if step is None:  # not an engine step: the layer as it always was
        return original(*args, **kwargs)
    # the layer's input; its cache argument is replaced by this step's per-request states, and the
    # rest (acb's attention plumbing, transformers' flash kwargs, a padding mask) is not passed:
    # the layer's torch path needs none of it, and its conv kernel would take it for varlen arguments
    hidden_states = args[0] if args else kwargs["hidden_states"]
    states = step.states
    decode = [(lo, row) for lo, hi, row in step.segments if hi - lo == 1 and layer in states.valid[row]]
    if len(decode) < 2:  # one call per request
        outs = [
            _call(original, cache_arg, hidden_states[:, lo:hi], _RequestCache(states, row))
            for lo, hi, row in step.segments
        ]
        return outs[0] if len(outs) == 1 else _cat(outs)
    # the decode rows in one batched call of the layer (one token each, as model.generate's
    # batched decode), the others one call per request
    batch = _BatchCache(states, [row for _, row in decode], layer)
    at = torch.tensor([lo for lo, _ in decode], dtype=torch.long, device=hidden_states.device)
    rows_out = _call(original, cache_arg, hidden_states[0, at].unsqueeze(1), batch)  # [B, 1, ...] each
    batch.scatter(layer)
    batched = set(batch.rows)
    total = hidden_states.shape[1]
    single = not isinstance(rows_out, tuple)
    parts = (rows_out,) if single else rows_out
    outs = [torch.empty((1, total, *p.shape[2:]), dtype=p.dtype, device=p.device) for p in parts]
    for out, p in zip(outs, parts):
        out[0, at] = p[:, 0]
    for lo, hi, row in step.segments:
        if not (hi - lo == 1 and row in batched):
            got = _call(original, cache_arg, hidden_states[:, lo:hi], _RequestCache(states, row))
            for out, p in zip(outs, (got,) if single else got):
                out[:, lo:hi] = p
    return outs[0] if single else tuple(outs)


def _cache_arg(layer: torch.nn.Module) -> str:
    """The name of the layer's cache argument (``cache_params`` for the SSM and gated-delta-rule
    layers; ``past_key_values`` for a projection inside an attention layer, Zaya's)."""
    params = inspect.signature(type(layer).forward).parameters  # (the class's: not acb's interception)
    return next((name for name in ("cache_params", "past_key_values", "cache") if name in params), "cache_params")


def resumes_prefill(layer: torch.nn.Module, hidden_size: int) -> bool:
    """Whether ``layer`` continues a prefill from the state an earlier chunk left: the same tokens
    in two chunks give what they give whole. The gated delta rule and Mamba2's chunk scan take
    the state in; Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba) does not, so a model with
    such layers must prefill each prompt in one step. Tried once per layer class, at start, on
    a scratch state (a layer that fails the try is taken as one that cannot)."""
    param = next(layer.parameters(), None)
    if param is None:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, hidden_size, generator=g).to(param.device, param.dtype)
    arg = _cache_arg(layer)
    try:
        with torch.no_grad():
            whole = layer(x, **{arg: _RequestCache(LinearStates(1, param.device), 0)})
            states = LinearStates(1, param.device)
            layer(x[:, :7], **{arg: _RequestCache(states, 0)})
            second = layer(x[:, 7:], **{arg: _RequestCache(states, 0)})
    except Exception:  # noqa: BLE001 - a layer that cannot run the try alone: prefill whole, to be safe
        return False
    pairs = zip(second, whole) if isinstance(whole, tuple) else [(second, whole)]
    for got, full in pairs:
        want = full[:, 7:].float()
        if not torch.allclose(got.float(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6):
            return False
    return True


class LinearLayers:
    """The interception of a model's linear layers (installed for an engine's life)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = linear_layers(model)
        for layer in self.layers:
            original = layer.forward
            arg = _cache_arg(layer)
            layer.forward = lambda *a, _o=original, _i=layer.layer_idx, _c=arg, **k: _forward(_o, _i, _c, *a, **k)

    def remove(self) -> None:
        for layer in self.layers:
            if "forward" in vars(layer):
                del layer.forward
        self.layers = []
