"""oneDNN-packed copies of a model's linear weights, for the engine's forward on CPU.

On CPU, ``torch.nn.functional.linear`` calls MKL's sgemm on the weight as the model holds it.
oneDNN's inner-product primitive on a weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight prepacking uses) is
1.2-2x faster at the row counts a decode step has (tens of rows; ``benchmarks/cpu_matmul.py``
measures both), and its rows do not depend on how many rows share the call.

The user's model is not touched: the packed copies live here, and a ``TorchFunctionMode``
entered around the engine's forward (on the engine thread only) sends ``F.linear`` calls on
packed weights to oneDNN. The mode costs a few microseconds per torch call of the forward, so
it is used only where it was measured to pay (``MIN_LAYER_PARAMS``, ``MIN_STEP_TOKENS``,
``MAX_STEP_TOKENS``).
Every other call, and every call outside the engine's step, runs as before. The copies cost
the linear weights' size in host memory once more, and are made again when the weights change,
by the same key that guards the prefix cache (:class:`acb.runner.weights.WeightWatch`: the
weights' objects, version counters, storage addresses, optimizer steps); the linears are looked
up again then, so a replaced weight or module is packed in its new form. In-place writes through ``.data`` outside an optimizer are
not seen: call ``reset_prefix_cache()`` after those, which drops the copies too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_LINEAR = torch.nn.functional.linear

# Where packing pays, measured on a 2-core AVX2 CPU (whole forwards, packed against plain, the
# same process): the function mode costs about 5 us for each of the forward's torch calls
# (about 40 per layer), and oneDNN was faster only at up to about a hundred rows per call.
# Llama hidden 512 (3.9M linear parameters per layer): 1.1-1.5x at 4-128 tokens, 0.87-0.94x at
# 256-2048; hidden 1024: 1.1-1.5x at 1-8 tokens, 0.92-0.99x at 64-1024; hidden 256 (0.8M per
# layer): 0.6-0.9x at every size. So, by default, only models of at least MIN_LAYER_PARAMS
# linear parameters per layer use it, and only on steps of at most MAX_STEP_TOKENS tokens
# (decode steps; prefill chunks keep MKL).
# A step of one token (one request decoding) is the exception: MKL's matrix-vector product beats
# oneDNN's inner product there (benchmarks/small_batch.py's engines, packed against plain on the
# same model in one run, 2026-11-28: hidden 512, 30.2 against 41.1 ms per step; hidden 1024,
# 33.5 against 42.1), while oneDNN wins from 2 rows on (1.13-1.26x at hidden 512, 1.46-1.81x at
# hidden 1024). So one-token steps keep MKL too.
MIN_LAYER_PARAMS = 2_000_000
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
        w = m.weight
        if type(w) is torch.nn.Parameter and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous():
            out.append(m)
    return out


class _PackedMode(TorchFunctionMode):
    def __init__(self, table: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is _LINEAR:
            packed = self.table.get(id(args[1] if len(args) > 1 else kwargs["weight"]))
            if packed is not None:
                bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
                x = args[0] if args else kwargs["input"]
                if x.dtype == torch.float32 and x.device.type == "cpu":
                    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return func(*args, **(kwargs or {}))


class PackedLinears:
    """The packed weights of a model's float32 linears, kept in step with the weights."""

    def __init__(
        self, model: torch.nn.Module, weights_key: Callable[[], Hashable], max_step_tokens: int = MAX_STEP_TOKENS
    ) -> None:
        self._model = model
        self._weights = [m.weight for m in _linears(model)]
        self.max_step_tokens = max_step_tokens  # larger steps run the model's own linears
        self._weights_key = weights_key  # changes when the weights do (the runner's, shared with the prefix cache)
        self._table: dict[int, torch.Tensor] = {}
        self._key: Hashable | None = None
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
            self._weights = [m.weight for m in _linears(self._model)]
        with torch.no_grad():
            self._table = {id(w): torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) for w in self._weights}
        self._key = key
        self.packs += 1
        logger.debug("packed %d linear weights for oneDNN (%.1f MiB)", len(self._weights), self.nbytes / 2**20)

    def release(self) -> int:
        """Drop the copies (``sleep``, or weights changed in a way the key cannot see); the next
        step packs again. Returns the bytes freed."""
        n = self.nbytes
        self._table = {}
        self._key = None
        return n

    def active(self, tokens: int) -> contextlib.AbstractContextManager:
        """The packed path for ``F.linear`` calls in this block (this thread only), when a step
        of ``tokens`` tokens is small enough to gain from it (and more than one token); else nothing."""
        if tokens > self.max_step_tokens or tokens < MIN_STEP_TOKENS:
            return contextlib.nullcontext()
        self.refresh()
        return _PackedMode(self._table)
