"""The batch-invariant mode on layers acb runs on the model's own cache (DeepSeek V4's compressed
attention: :mod:`acb.runner.unpaged_layers`): see :mod:`acb.runner.batch_invariant`."""

from __future__ import annotations

import torch


def unpaged_refusal(model: torch.nn.Module) -> str | None:
    """Why the mode cannot run ``model``'s unpaged layers (None: it can)."""
    return "unpaged layers (DeepSeek V4's compressed attention caches): not covered yet"
