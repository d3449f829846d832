"""Eval semantics for the engine's forwards, without touching the model's ``training`` flags.

An RL trainer trains the very model the engine generates with, often on another thread at the
same time (async GRPO). ``module.training`` is shared state: if engine steps flipped it
(``model.eval()`` ... ``model.train()``), the user's concurrent training forward would run
some of its dropout in eval mode, and the engine's steps would run some in train mode. So the
engine never writes it. Instead:

- acb's attention function ignores the ``dropout`` argument that transformers' attention
  modules compute from ``self.training`` (it is called only by engine steps);
- every dropout module of the model (``nn.Dropout`` and its kin) answers with its input when
  called from a thread that is inside an engine forward (the thread's step context, which the
  runner sets around every forward: ``acb.runner.attention.in_step``), and as usual from any
  other thread.

That covers the ``training``-dependent computation of the architectures transformers' attention
interface serves (dropout and attention dropout). Python branches a model's own code takes on
``self.training`` besides those (MoE router jitter noise, a ``training``-only auxiliary loss)
still see the flag as the user set it; the README says so.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from acb.runner.attention import in_step

_DROPOUTS = (nn.modules.dropout._DropoutNd,)


class _NoDropoutInEngine:
    """A dropout module's ``forward``, as an instance attribute: the identity inside an engine
    forward, the class's own ``forward`` anywhere else."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if in_step():
            return x
        return type(self.module).forward(self.module, x, *args, **kwargs)


class DropoutGuard:
    """Installs :class:`_NoDropoutInEngine` on a model's dropout modules for as long as any
    runner uses the model (counted per model, as the attention swap is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[int, int] = {}

    def acquire(self, model: nn.Module) -> None:
        with self._lock:
            n = self._users.get(id(model), 0)
            if n == 0:
                for m in model.modules():
                    if isinstance(m, _DROPOUTS) and "forward" not in m.__dict__:
                        m.forward = _NoDropoutInEngine(m)
            self._users[id(model)] = n + 1

    def release(self, model: nn.Module) -> None:
        with self._lock:
            n = self._users.pop(id(model), 0)
            if n > 1:
                self._users[id(model)] = n - 1
                return
            for m in model.modules():
                if isinstance(m.__dict__.get("forward"), _NoDropoutInEngine):
                    del m.__dict__["forward"]


DROPOUT_GUARD = DropoutGuard()
