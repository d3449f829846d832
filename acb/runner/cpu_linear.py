"""oneDNN-packed copies of a model's linear weights, for the engine's forward on CPU.

On CPU, ``torch.nn.functional.linear`` calls MKL's sgemm on the weight as the model holds it.
oneDNN's inner-product primitive on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight prepacking uses) is
1.2-2x faster at the row counts a decode step has (tens of rows; ``benchmarks/cpu_matmul.py``
measures both), and its rows do not depend on how many rows share the call.

The packed copies live here. Each packed ``nn.Linear`` gets an instance ``forward`` (a method
bound to it, so a ``copy.deepcopy`` of the model binds the copy's to the copy) that looks at a
thread-local table, set only on the engine thread around its forward: there, a call on a
packed weight goes to oneDNN; on any other thread (a trainer's forward and backward), or
outside the engine's step, the table is unset and the class's own ``forward`` runs. The route
costs about a microsecond per linear call (until 2026-11-28 a ``TorchFunctionMode`` did this; it
saw every torch call of the forward, about 980 per step of an 8-layer Llama, and cost about 4 ms
per step). It is used only where packing was measured to pay (``MIN_LAYER_PARAMS``,
``MIN_STEP_TOKENS``, ``MAX_STEP_TOKENS``), and removed when the engine closes. The copies cost
the linear weights' size in host memory once more, and are made again when the weights change,
by the same key that guards the prefix cache (:class:`acb.runner.weights.WeightWatch`: the
weights' objects, version counters, storage addresses, optimizer steps); the linears are looked
up again then, so a replaced weight or module is packed in its new form. In-place writes through ``.data`` outside an optimizer are
not seen: call ``reset_prefix_cache()`` after those, which drops the copies too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
import weakref
from collections.abc import Callable, Hashable, Iterator

import torch

logger = logging.getLogger(__name__)

# Where packing pays, measured on a 2-core AVX2 CPU, oneDNN being faster only at up to about a
# hundred rows per call. Whole forwards, packed against plain, the same process:
# Llama hidden 512 (3.9M linear parameters per layer): 1.1-1.5x at 4-128 tokens, 0.87-0.94x at
# 256-2048; hidden 1024: 1.1-1.5x at 1-8 tokens, 0.92-0.99x at 64-1024. So packing is used only on
# steps of at most MAX_STEP_TOKENS tokens (decode steps; prefill chunks keep MKL).
# Model size: with the TorchFunctionMode route of before 2026-11-28 (about 5 us for each of the
# forward's torch calls) packing lost below 2M linear parameters per layer (hidden 256: 0.6-0.9x).
# With the per-module route, engines packed and plain on the same model, one run
# (benchmarks/cpu_packed_linears.py, 2026-11-28, decode steps at B = 2, 4, 16, 64): hidden 128
# (0.38M per layer) 1.13x / 1.22x / 1.12x / 0.99x, hidden 256 (1.25M) 1.15x / 1.10x / 1.27x / 1.01x,
# hidden 384 (2.61M) 1.27x / 1.34x / 1.19x / 0.99x. So MIN_LAYER_PARAMS is now 250k: hidden 128 and
# up (the tests' tiny models, hidden 64, stay on MKL unless asked).
# A step of one token (one request decoding) is the exception: MKL's matrix-vector product beats
# oneDNN's inner product there (benchmarks/small_batch.py's engines, packed against plain on the
# same model in one run, 2026-11-28: hidden 512, 30.2 against 41.1 ms per step; hidden 1024,
# 33.5 against 42.1), while oneDNN wins from 2 rows on (1.13-1.26x at hidden 512, 1.46-1.81x at
# hidden 1024). So one-token steps keep MKL too.
MIN_LAYER_PARAMS = 250_000
MIN_STEP_TOKENS = 2
MAX_STEP_TOKENS = 128


def packable(model: torch.nn.Module) -> str | None:
    """None when the model's linears can be packed for its device, else why not."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return "not on CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN weight prepacking"
    return None


def linear_params_per_layer(model: torch.nn.Module) -> float:
    """The packable linear parameters per decoder layer (all of them over the layer count)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    layers = max(1, int(getattr(text, "num_hidden_layers", 1) or 1))
    return sum(m.weight.numel() for m in _linears(model)) / layers


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain float32 ``nn.Linear`` modules (subclasses, quantized or sharded weights are left alone)."""
    out = []
    for m in model.modules():
        if type(m) is not torch.nn.Linear:
            continue
        if "forward" in vars(m) and not _is_route(m):  # someone else's hook (accelerate's offload): left alone
            continue
        w = m.weight
        if type(w) is torch.nn.Parameter and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous():
            out.append(m)
    return out


_TLS = threading.local()  # .table: the packed weights by id(weight), on the engine thread in its step
_ROUTED: weakref.WeakKeyDictionary[torch.nn.Linear, int] = weakref.WeakKeyDictionary()  # engines per module


def _routed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A packed linear's ``forward``: oneDNN on this thread's packed copy, when there is one."""
    table = getattr(_TLS, "table", None)
    if table is not None:
        packed = table.get(id(self.weight))
        if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    return type(self).forward(self, x)


def _is_route(m: torch.nn.Module) -> bool:
    f = vars(m).get("forward")
    return isinstance(f, types.MethodType) and f.__func__ is _routed_forward


def _route(modules: list[torch.nn.Linear]) -> None:
    for m in modules:
        n = _ROUTED.get(m, 0)
        if n == 0 or not _is_route(m):
            m.forward = types.MethodType(_routed_forward, m)  # type: ignore[method-assign]
        _ROUTED[m] = n + 1


def _unroute(modules: list[torch.nn.Linear]) -> None:
    for m in modules:
        n = _ROUTED.get(m, 0) - 1
        if n > 0:
            _ROUTED[m] = n
            continue
        _ROUTED.pop(m, None)
        if _is_route(m):
            del m.forward


@contextlib.contextmanager
def _on_this_thread(table: dict[int, torch.Tensor]) -> Iterator[None]:
    prev = getattr(_TLS, "table", None)
    _TLS.table = table
    try:
        yield
    finally:
        _TLS.table = prev


class PackedLinears:
    """The packed weights of a model's float32 linears, kept in step with the weights."""

    def __init__(
        self, model: torch.nn.Module, weights_key: Callable[[], Hashable], max_step_tokens: int = MAX_STEP_TOKENS
    ) -> None:
        self._model = model
        self._modules = _linears(model)
        self._weights = [m.weight for m in self._modules]
        self.max_step_tokens = max_step_tokens  # larger steps run the model's own linears
        self._weights_key = weights_key  # changes when the weights do (the runner's, shared with the prefix cache)
        self._table: dict[int, torch.Tensor] = {}
        self._key: Hashable | None = None
        self._routed = False
        self.packs = 0  # how many times the weights were packed (tests, logs)

    def __len__(self) -> int:
        return len(self._weights)

    @property
    def nbytes(self) -> int:
        """Host memory of the packed copies (their logical size; oneDNN may pad a little)."""
        return sum(w.numel() * w.element_size() for w in self._weights) if self._table else 0

    def refresh(self) -> None:
        """Pack the weights, unless the copies are current."""
        key = self._weights_key()
        if key == self._key and self._table:
            return
        if self.packs:  # the weights changed: which objects they are may have, too
            modules = _linears(self._model)
            if modules != self._modules:  # a module replaced: route the new ones
                _unroute(self._modules)
                self._modules = modules
                if self._routed:
                    _route(modules)
            self._weights = [m.weight for m in modules]
        with torch.no_grad():
            self._table = {id(w): torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) for w in self._weights}
        self._key = key
        if not self._routed:
            _route(self._modules)
            self._routed = True
        self.packs += 1
        logger.debug("packed %d linear weights for oneDNN (%.1f MiB)", len(self._weights), self.nbytes / 2**20)

    def release(self) -> int:
        """Drop the copies (``sleep``, or weights changed in a way the key cannot see); the next
        step packs again. Returns the bytes freed."""
        n = self.nbytes
        self._table = {}
        self._key = None
        return n

    def remove(self) -> None:
        """Give the modules their own ``forward`` back and drop the copies (the engine closes)."""
        if self._routed:
            _unroute(self._modules)
            self._routed = False
        self.release()

    def active(self, tokens: int) -> contextlib.AbstractContextManager:
        """The packed path for the packed linears' calls in this block (this thread only), when a
        step of ``tokens`` tokens is small enough to gain from it (and more than one token); else
        nothing."""
        if tokens > self.max_step_tokens or tokens < MIN_STEP_TOKENS:
            return contextlib.nullcontext()
        self.refresh()
        return _on_this_thread(self._table)
