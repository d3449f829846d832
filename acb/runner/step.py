"""The engine step as the layers' interceptions see it: one thread-local context, one field per
layer kind.

A step runs on its engine's thread; inside it each kind's interception reads its part of the step
from :data:`CURRENT` (outside a step every field is None, and an intercepted layer runs as it
always did). Each engine has its own thread, so two engines on one model see their own steps
through the same interception (:class:`acb.runner.intercept.Interception`). The fields are set for
a block with :func:`entered` (nested blocks restore the outer value), by the kinds' own context
managers: ``attention.step_context``, ``linear_state.linear_step``, ``indexed.indexed_step``,
``unpaged_layers.unpaged_step``, ``attention.SharedAttention`` (``called_layer``),
``attention.own_attention_here`` (``own_attention``) and ``kinds.LoraHooks`` (``lora``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class _Step(threading.local):
    def __init__(self) -> None:
        self.attention: Any = None  # attention.StepContext: the KV cache, the backend, the metadata
        self.states: Any = None  # linear_state: the state layers' rows and the step's segments
        self.index: Any = None  # indexed: the indexers' key pages and the step's segments
        self.unpaged: Any = None  # unpaged_layers: the own-cache layers' caches and segments
        self.called_layer: int | None = None  # the layer calling a shared attention module (Zamba2)
        self.own_attention: bool = False  # inside an own-cache layer: its attention is the model's own
        self.lora: Any = None  # lora.LoraStep: the adapters' buffers and the step's adapter rows (None: none)


CURRENT = _Step()


@contextlib.contextmanager
def entered(field: str, value: Any) -> Iterator[None]:
    """``CURRENT.<field>`` is ``value`` within the block (this thread only)."""
    prev = getattr(CURRENT, field)
    setattr(CURRENT, field, value)
    try:
        yield
    finally:
        setattr(CURRENT, field, prev)
