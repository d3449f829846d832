"""The batch-invariant mode on the second runner path (models on their own cache objects:
:mod:`acb.runner.own_cache_runner`): see :mod:`acb.runner.batch_invariant`."""

from __future__ import annotations

import torch


def own_cache_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run ``model`` on its own cache objects (None: it can)."""
    return "the model runs on its own cache objects (runner='own_cache'), whose attention is the model's own"
